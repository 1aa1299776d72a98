"""Image and video inputs: pixel values sized from the config (nested vision or backbone configs included)
or the model's own patch embeddings, videos with a frames axis, flattened patches (Fuyu), masks over
patches (`bool_masked_pos`), the noise that drives random masking (ViT-MAE), so that reruns agree, SigLIP 2's
native-resolution patches, and the patch lists with their grids that Qwen-VL-style vision towers read."""
from __future__ import annotations

import inspect
import math

import torch
from torch import nn

from normswap.models.inputs.context import VISION, Ctx, pair

DEFAULT_SIZE = 224   # image models whose config names no size (convolutional backbones)
GRIDS = ("grid_thw", "image_grid_thw")   # each image's (frames, rows, columns) of patches


def image_size(ctx: Ctx) -> tuple[int, int]:
    """(height, width): the config's image_size / crop_size (vision or backbone config included), else the
    size the patch embeddings were built for, else 224."""
    size = pair(ctx.value("image_size", "crop_size", "input_size", prefer=VISION)) or \
        pair(ctx.module_attr("image_size"))
    return size or (DEFAULT_SIZE, DEFAULT_SIZE)


def patch(ctx: Ctx) -> tuple[int, int] | None:
    return pair(ctx.value("patch_size", prefer=VISION))


def channels(ctx: Ctx) -> int:
    return ctx.integer("num_channels", "image_channels", prefer=VISION, default=3)


def frames(ctx: Ctx) -> int | None:
    """Frames of a video model (ViViT, VideoMAE, TimeSformer, V-JEPA 2), else None."""
    return ctx.integer("num_frames", "frames_per_clip", prefer=VISION)


def pixels(ctx: Ctx, b: int, video: bool = False) -> torch.Tensor:
    """(b, channels, h, w), or (b, frames, channels, h, w) for a video."""
    h, w = image_size(ctx)
    c = channels(ctx)
    if video:
        return ctx.randn(b, frames(ctx) or 8, c, h, w)
    return ctx.randn(b, c, h, w)


def flat_patches(ctx: Ctx, b: int) -> torch.Tensor | None:
    """Images as flattened patches (b, patches, channels x patch x patch): Fuyu's pixel_values."""
    p = patch(ctx)
    if p is None:
        return None
    h, w = image_size(ctx)
    return ctx.randn(b, (h // p[0]) * (w // p[1]), channels(ctx) * p[0] * p[1])


def num_patches(ctx: Ctx) -> int | None:
    """Tokens the patch embedding makes: its own num_patches, else image (and tubelet) size over patch size."""
    n = ctx.module_attr("num_patches")
    if isinstance(n, int):
        return n
    p, (h, w) = patch(ctx), image_size(ctx)
    if p is None:
        return None
    n = (h // p[0]) * (w // p[1])
    t = frames(ctx)
    if t:
        tub = ctx.value("tubelet_size", prefer=VISION, default=1)
        n *= t // (tub[0] if isinstance(tub, (list, tuple)) else tub)
    return n


def masked_positions(ctx: Ctx, b: int) -> torch.Tensor:
    """bool_masked_pos: the same number of masked patches in every row (VideoMAE drops them)."""
    n = num_patches(ctx)
    if n is None:
        raise ctx.refuse("`bool_masked_pos` needs the number of patches (no `patch_size` in the config)")
    order = torch.rand(b, n, generator=ctx.g).argsort(dim=1)
    return order < max(1, int(0.4 * n))


def reads_masks(ctx: Ctx) -> bool:
    """False where the model's embeddings have a `mask_token` slot left empty (Swin, ViT-MSN built without
    one): `bool_masked_pos` then has nothing to write."""
    if ctx.module is None:
        return True
    slots = [m.mask_token for m in ctx.module.modules() if hasattr(m, "mask_token")]
    return not slots or any(s is not None for s in slots)


def noise(ctx: Ctx, b: int) -> torch.Tensor | None:
    """ViT-MAE's masking noise: without it each forward masks other patches and no two runs agree."""
    n = num_patches(ctx)
    return None if n is None else ctx.rand(b, n)


def high_res(ctx: Ctx, b: int) -> torch.Tensor | None:
    """The same b images at the size of a second, high-resolution tower (DeepSeek-VL hybrid's SAM encoder)."""
    config = getattr(ctx.config, "high_res_vision_config", None)
    size = pair(getattr(config, "image_size", None))
    return None if size is None else ctx.randn(b, getattr(config, "num_channels", 3), *size)


def regions(ctx: Ctx, b: int) -> dict:
    """Detected regions' features and boxes (b, 8 regions, dims), for a model that reads them (LXMERT)."""
    feats, boxes = ctx.integer("visual_feat_dim"), ctx.integer("visual_pos_dim")
    if not ctx.has("visual_feats") or feats is None or boxes is None:
        return {}
    return {"visual_feats": ctx.randn(b, 8, feats), "visual_pos": ctx.rand(b, 8, boxes)}


def image_tokens_per_image(ctx: Ctx) -> int | None:
    """A first guess at how many image tokens one image fills in the text (LLaVA-style models); a trial
    forward corrects it where the model reports the true count."""
    n = ctx.integer("image_seq_length", "num_image_tokens", "mm_tokens_per_image", "num_query_tokens",
                    "latent_query_num")
    if n is not None:
        return n
    p, (h, w) = patch(ctx), image_size(ctx)
    if p is None:
        return None
    n = (h // p[0]) * (w // p[1])
    return n + 1 if ctx.value("vision_feature_select_strategy") == "full" else n


def image_token(ctx: Ctx) -> int | None:
    """The token images fill; a model whose only visual input is `pixel_values` and whose only such token is
    a video token reads videos there (InstructBLIP-Video)."""
    token = ctx.integer("image_token_id", "image_token_index", minimum=0)
    return video_token(ctx) if token is None and not ctx.has("pixel_values_videos") else token


def video_token(ctx: Ctx) -> int | None:
    return ctx.integer("video_token_id", "video_token_index", minimum=0)


def naflex(ctx: Ctx, b: int, wide: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """SigLIP 2's native-resolution images: b images of 4x4 (`wide`: 4x8) patches, each flattened, the mask
    of real patches and each image's (rows, columns); None without a patch size."""
    p = patch(ctx)
    if p is None:
        return None
    rows, cols = 4, 8 if wide else 4
    pixels = ctx.randn(b, rows * cols, channels(ctx) * p[0] * p[1])
    return pixels, torch.ones(b, rows * cols, dtype=torch.long), torch.tensor([[rows, cols]] * b)


def packed(ctx: Ctx, b: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """NaViT-packed images (MiniCPM-V): the patches of b images of 4x4 patches (native resolution: any grid its
    2x2 merges divide) side by side in one strip of pixels (1, channels, patch, patches x patch), and each
    image's (rows, columns) of patches; None without a patch size."""
    p = patch(ctx)
    if p is None:
        return None
    rows = cols = 4
    return ctx.randn(1, channels(ctx), p[0], b * rows * cols * p[1]), torch.tensor([[rows, cols]] * b)


def grid_tower(ctx: Ctx) -> str | None:
    """The grid argument of a vision tower that reads all images as one list of patches with each image's
    (frames, rows, columns) beside it (Qwen-VL, GLM-4V, Kimi, Video-LLaMA 3...), else None."""
    return None if ctx.has("input_ids") else next((n for n in GRIDS if ctx.has(n)), None)


def merge(ctx: Ctx) -> int:
    """How many patches a side the tower merges into one token (its grid's rows and columns are multiples)."""
    size = pair(ctx.value("spatial_merge_size", "merge_size", "merge_kernel_size", prefer=VISION))
    return size[0] if size else 1


def merges(ctx: Ctx, n: int) -> torch.Tensor:
    """Each of n images' merge, for towers that take it per image (Video-LLaMA 3)."""
    return torch.full((n,), merge(ctx))


def patch_width(ctx: Ctx) -> int | None:
    """Values in one flattened patch: what the grid tower's patch embedding (its first linear or convolution,
    within a module named as an embedding where it has one: Qwen3-Omni registers its mergers first) reads, else
    channels x frames per patch x patch area from the config."""
    reader = tower(ctx)
    named = sorted(reader.named_modules() if reader is not None else (), key=lambda nm: "embed" not in nm[0])
    for _, m in named:
        if isinstance(m, nn.Linear):
            return m.in_features
        if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            return m.in_channels * math.prod(m.kernel_size)
    p = patch(ctx)
    frames_per_patch = ctx.integer("temporal_patch_size", "patch_temporal", prefer=VISION, default=1)
    return None if p is None else channels(ctx) * frames_per_patch * p[0] * p[1]


def tower(ctx: Ctx) -> nn.Module | None:
    """The module (the model itself, or one inside it) whose forward reads patches with their grid."""
    for m in ctx.module.modules() if ctx.module is not None else ():
        names = inspect.signature(m.forward).parameters
        if any(n in names for n in GRIDS) and "input_ids" not in names:
            return m
    return None


def grid_patches(ctx: Ctx, b: int, wide: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """b images of 2x2 (`wide`: 2x4) merged tokens as one (patches, width) list, and their grid (b, 3)."""
    width, m = patch_width(ctx), merge(ctx)
    if width is None:
        raise ctx.refuse("flattened patches need a `patch_size` in the config")
    rows, cols = 2 * m, (4 if wide else 2) * m
    return ctx.randn(b * rows * cols, width), torch.tensor([[1, rows, cols]] * b)


def patch_shapes(ctx: Ctx, patches: torch.Tensor) -> list[torch.Tensor]:
    """The same patches in each shape grid towers read them in: a flat list (Qwen-VL), small images
    (patches, channels, p, p) (Kimi), and those with a batch axis (PaddleOCR-VL); the first only where the
    width is not channels x p x p."""
    p, c = patch(ctx), channels(ctx)
    if p is None or patches.shape[-1] != c * p[0] * p[1]:
        return [patches]
    square = patches.reshape(-1, c, p[0], p[1])
    return [patches, square, square[None]]
