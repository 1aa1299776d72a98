"""Image and video inputs: pixel values sized from the config (nested vision or backbone configs included)
or the model's own patch embeddings, videos with a frames axis, flattened patches (Fuyu), masks over
patches (`bool_masked_pos`) and the noise that drives random masking (ViT-MAE), so that reruns agree."""
from __future__ import annotations

import torch

from normswap.models.inputs.context import VISION, Ctx, pair

DEFAULT_SIZE = 224   # image models whose config names no size (convolutional backbones)


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


def image_tokens_per_image(ctx: Ctx) -> int | None:
    """A first guess at how many image tokens one image fills in the text (LLaVA-style models); a trial
    forward corrects it where the model reports the true count."""
    n = ctx.integer("image_seq_length", "num_image_tokens", "mm_tokens_per_image", "num_query_tokens")
    if n is not None:
        return n
    p, (h, w) = patch(ctx), image_size(ctx)
    if p is None:
        return None
    n = (h // p[0]) * (w // p[1])
    return n + 1 if ctx.value("vision_feature_select_strategy") == "full" else n


def image_token(ctx: Ctx) -> int | None:
    return ctx.integer("image_token_id", "image_token_index", minimum=0)
