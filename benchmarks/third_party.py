"""Exact conversion of third-party model code through the plain API with `example_inputs`: an unseen set.

Tiny models (random weights, fixed seed, eval mode) from libraries no test or benchmark of the repository imports
(issue 48's set, picked before its fixes: diffusers, lucidrains' PaLM / perceiver / tab-transformer / CoCa /
linformer / MEGABYTE, kornia, segmentation_models_pytorch), or with `--set issue30` issue 30's timm, torchvision,
open_clip and torch.nn set, or with `--set engine` the real models issue 48's engine fixes were checked on
(vit-pytorch's CaiT, MONAI's ViT and SwinUNETR, timm's EfficientFormer). Each model is built fresh, its outputs on
OTHER inputs than the examples (another batch size, length, image size, mask) recorded first, then converted as a
new user would,
`normswap.convert(model, method="exact", example_inputs=...)`, and judged on those other inputs:

    EXACT      every LayerNorm converted, every output within 1e-5 of its max |value| (fp32)
    PARTIAL    exact, some norms kept as LayerNorms (named by the report)
    NONE       nothing to convert (no LayerNorm on the residual stream: channels-first norms, RMSNorm models)
    REFUSED    a NormswapError, its first line
    WRONG      converted, but the outputs on the other inputs differ: the failure this table exists for
    CRASH      any other exception out of normswap (a traceback from inside it)
    unbuilt    the library's own code failed on these tiny settings (no normswap result)

Then, for an EXACT / PARTIAL / NONE model: `normswap.export_onnx(model, f, example_inputs=...)` (normswap's own
onnxruntime validation), the file run in onnxruntime on the other inputs against the recorded outputs
(`onnx`: OK, fixed (a graph of the example's shapes: the other inputs not run), or the failure); and
`normswap.save` + `normswap.restore` into a fresh instance, outputs bit-identical (`restore`: OK or why not).

Run: `python benchmarks/third_party.py [--set issue48|issue30|engine] [--only WORD] [--out DIR]` (DIR gets
third_party.md and third_party.json). Exit status 1 on any WRONG or CRASH.
"""
from __future__ import annotations

import argparse
import importlib.util
import importlib.metadata
import json
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

import normswap
from normswap.errors import NormswapError
from normswap.parity import tensors

TOL = 1e-5
ONNX_TOL = 1e-4


@dataclass
class Case:
    library: str          # the distribution it comes from (its version is printed)
    name: str
    build: Callable[[], nn.Module]
    examples: list        # example_inputs: batches (tensor, tuple of positional args, dict of keywords)
    others: list          # the judging batches


@dataclass
class Row:
    library: str
    model: str
    result: str
    detail: str
    onnx: str = "-"
    restore: str = "-"
    seconds: float = 0.0


def perturbed(model: nn.Module) -> nn.Module:
    """Norm gains and biases away from 1 and 0, LayerScale gains away from their tiny init, zero-initialised
    weights (heads, adaLN-Zero modulations) random: as trained."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            for pname, p in module.named_parameters(recurse=False):
                if isinstance(module, nn.LayerNorm) or "Norm" in type(module).__name__ and p.dim() == 1:
                    p.copy_((pname in ("weight", "gamma", "g", "scale")) + 0.3 * torch.randn(p.shape, generator=g))
                elif p.dim() == 1 and pname in ("gamma", "gamma_1", "gamma_2", "scale"):
                    p.copy_(0.5 + 0.3 * torch.randn(p.shape, generator=g))
                elif p.is_floating_point() and p.numel() > 1 and not p.any():
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


def named_call(model: nn.Module, batch) -> dict[str, torch.Tensor]:
    """The floating outputs by dotted name (as the conversion report names them), in fp64."""
    with torch.no_grad():
        out = model(*batch) if isinstance(batch, tuple) else model(**batch) if isinstance(batch, dict) \
            else model(batch)
    return {name or "output": t.double() for name, t in tensors(out) if t.is_floating_point()}


def call(model: nn.Module, batch) -> list[torch.Tensor]:
    return list(named_call(model, batch).values())


def kept(outs: dict[str, torch.Tensor], changed) -> list[torch.Tensor]:
    """The outputs a conversion keeps: all but those its report says it changes by design (`not_preserved`:
    per-layer residual streams a model returns, centred)."""
    return [t for name, t in outs.items() if name not in changed]


def worst(outs: list[list[torch.Tensor]], refs: list[list[torch.Tensor]]) -> float:
    """Max over batches and outputs of max |a - b| / max |b|."""
    return max((((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
                for out, ref in zip(outs, refs) for a, b in zip(out, ref)), default=0.0)


def first_line(e: BaseException, n: int = 200) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:n]


def crash(e: BaseException) -> str:
    """The exception and where in normswap it was raised (the innermost normswap frame)."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "/normswap/" in f.filename]
    where = f" at {frames[-1].filename.split('/normswap/')[-1]}:{frames[-1].lineno}" if frames else ""
    return f"{type(e).__name__}: {first_line(e, 140)}{where}"


def onnx_check(model: nn.Module, case: Case, refs: list[dict], changed, tmp: Path) -> str:
    """export_onnx with its own validation, then the graph on the other inputs in onnxruntime (the outputs the
    conversion keeps: the graph returns every floating output, in order)."""
    import onnxruntime as ort

    from normswap.export import wrap
    from normswap.models.inputs.examples import as_batches

    path = tmp / "model.onnx"
    try:
        with warnings.catch_warnings():   # a fallback to fixed shapes warns; report.fixed_shapes says why
            warnings.simplefilter("ignore")
            report = normswap.export_onnx(model, path, example_inputs=case.examples)
    except NormswapError as e:
        return f"fail: {first_line(e, 160)}"
    except Exception as e:
        return f"CRASH: {crash(e)}"
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    graph = {i.name: i for i in sess.get_inputs()}
    errs = []
    for batch, ref in zip(as_batches(model, case.others), refs):
        feed = {n: t.numpy() for n, t in wrap.flat_inputs(batch) if n in graph}
        if any(len(graph[n].shape) != v.ndim or any(isinstance(d, int) and d != s for d, s in
                                                    zip(graph[n].shape, v.shape)) for n, v in feed.items()):
            why = report.fixed_shapes or "a dim of size 1 in the example"
            return f"fixed dims, other inputs not run ({why})"[:220]
        got = sess.run(None, feed)
        errs.append(max(float(np.abs(g - r.numpy()).max() / max(np.abs(r.numpy()).max(), 1e-30))
                        for g, (name, r) in zip(got, ref.items()) if name not in changed))
    err = max(errs, default=0.0)
    return f"OK ({err:.1e})" if err <= ONNX_TOL else f"WRONG on other inputs ({err:.1e})"


def restore_check(model: nn.Module, case: Case, tmp: Path) -> str:
    """normswap.save, then normswap.restore into a fresh (unconverted) instance: bit-identical outputs."""
    try:
        normswap.save(model, tmp / "saved")
        torch.manual_seed(0)
        fresh = normswap.restore(perturbed(case.build()), tmp / "saved").eval()
    except NormswapError as e:
        return f"fail: {first_line(e, 160)}"
    except Exception as e:
        return f"CRASH: {crash(e)}"
    same = all(torch.equal(a, b) for x in case.others for a, b in zip(call(model, x), call(fresh, x)))
    return "OK (bit-identical)" if same else "WRONG (outputs differ)"


def judge(case: Case, exports: bool = True) -> Row:
    """Build, record the original's outputs on the other inputs, convert, compare; then ONNX and restore."""
    row, start = Row(case.library, case.name, "", ""), time.perf_counter()
    torch.manual_seed(0)
    try:
        model = perturbed(case.build())
        named = [named_call(model, x) for x in case.others]
    except Exception as e:   # the library's own code on these tiny settings: not a normswap result
        row.result, row.detail = "unbuilt", f"{type(e).__name__}: {first_line(e, 120)}"
        return row
    before = sum(isinstance(m, nn.LayerNorm) or type(m).__name__ == "LayerNorm" for m in model.modules())
    try:
        report = normswap.convert(model, method="exact", example_inputs=case.examples)
    except NormswapError as e:
        row.result, row.detail = "REFUSED", first_line(e)
    except Exception as e:
        row.result, row.detail = "CRASH", crash(e)
    else:
        changed = report.not_preserved
        refs = [kept(r, changed) for r in named]
        err = worst([kept(named_call(model, x), changed) for x in case.others], refs)
        skipped = len(report.skipped)
        row.result = "WRONG" if err > TOL else "NONE" if not report.num_converted else \
            "PARTIAL" if skipped else "EXACT"
        row.detail = (f"{report.num_converted} converted of {before} LayerNorm(s), {skipped} kept, max rel {err:.1e}"
                      + (f" (kept: {', '.join(s.name for s in report.skipped)[:100]})" if skipped else "")
                      + (f"; returned centred, as the report says: {', '.join(changed)[:60]}" if changed else ""))
        if exports and row.result in ("EXACT", "PARTIAL", "NONE"):
            with tempfile.TemporaryDirectory() as tmp:
                row.onnx = onnx_check(model, case, named, changed, Path(tmp))
                row.restore = restore_check(model, case, Path(tmp)) if report.num_converted else "-"
    row.seconds = round(time.perf_counter() - start, 1)
    return row


# ---------------------------------------------------------------- the sets: one function per library, tiny models

def img(b: int, size: int = 32, c: int = 3) -> torch.Tensor:
    return torch.randn(b, c, size, size)


def ids(b: int, t: int, vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t))


def diffusers_cases() -> list[Case]:
    import diffusers as d

    def dit(**kw):
        return lambda: d.DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                               out_channels=4, num_layers=2, sample_size=8, patch_size=2,
                                               num_embeds_ada_norm=10, **kw)
    t = lambda b: torch.randint(0, 10, (b,))   # noqa: E731 (timesteps / class labels)
    dit_in = lambda b, s=8: {"hidden_states": torch.randn(b, 4, s, s), "timestep": t(b),   # noqa: E731
                             "class_labels": t(b)}
    pix_in = lambda b, s=8, n=5: {"hidden_states": torch.randn(b, 4, s, s),   # noqa: E731
                                  "encoder_hidden_states": torch.randn(b, n, 16), "timestep": t(b),
                                  "added_cond_kwargs": {"resolution": None, "aspect_ratio": None}}
    t2d = lambda: d.Transformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=16,  # noqa: E731
                                       num_layers=2, norm_num_groups=4, cross_attention_dim=16)
    t2d_in = lambda b, s=8, n=5: {"hidden_states": torch.randn(b, 16, s, s),   # noqa: E731
                                  "encoder_hidden_states": torch.randn(b, n, 16)}
    t2d_lin = lambda: d.Transformer2DModel(num_attention_heads=2, attention_head_dim=8,  # noqa: E731
                                           in_channels=16, num_layers=1, norm_num_groups=4,
                                           use_linear_projection=True)
    unet = lambda: d.UNet2DConditionModel(block_out_channels=(16, 32), layers_per_block=1, sample_size=16,  # noqa
                                          in_channels=4, out_channels=4, norm_num_groups=8,
                                          down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                          up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
                                          cross_attention_dim=16, attention_head_dim=8)
    unet_in = lambda b, s=16, n=5: {"sample": torch.randn(b, 4, s, s), "timestep": t(b),   # noqa: E731
                                    "encoder_hidden_states": torch.randn(b, n, 16)}
    sd3 = lambda: d.SD3Transformer2DModel(sample_size=8, patch_size=1, in_channels=4, num_layers=2,  # noqa
                                          attention_head_dim=8, num_attention_heads=2, caption_projection_dim=16,
                                          joint_attention_dim=16, pooled_projection_dim=16, out_channels=4,
                                          pos_embed_max_size=16)
    sd3_in = lambda b, s=8, n=5: {"hidden_states": torch.randn(b, 4, s, s), "timestep": t(b),   # noqa: E731
                                  "encoder_hidden_states": torch.randn(b, n, 16),
                                  "pooled_projections": torch.randn(b, 16)}
    pix = lambda: d.PixArtTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4,  # noqa
                                             out_channels=4, num_layers=2, sample_size=8, patch_size=2,
                                             cross_attention_dim=16, caption_channels=16)
    prior = lambda: d.PriorTransformer(num_attention_heads=2, attention_head_dim=8, num_layers=2,  # noqa: E731
                                       embedding_dim=16, num_embeddings=4, additional_embeddings=4)
    prior_in = lambda b: {"hidden_states": torch.randn(b, 16), "timestep": torch.tensor(5),   # noqa: E731
                          "proj_embedding": torch.randn(b, 16), "encoder_hidden_states": torch.randn(b, 4, 16),
                          "attention_mask": torch.arange(4).expand(b, 4) < torch.arange(4, 4 - b, -1)[:, None]}
    uvit = lambda: d.UVit2DModel(hidden_size=32, use_bias=False, hidden_dropout=0., cond_embed_dim=16,  # noqa
                                 micro_cond_encode_dim=2, micro_cond_embed_dim=10, encoder_hidden_size=16,
                                 vocab_size=32, codebook_size=31, in_channels=16, block_out_channels=16,
                                 num_res_blocks=1, downsample=False, upsample=False, block_num_heads=2,
                                 num_hidden_layers=1, num_attention_heads=2, attention_dropout=0.,
                                 intermediate_size=32, sample_size=4)
    uvit_in = lambda b, s=4, n=5: (torch.randint(0, 31, (b, s, s)), torch.randn(b, n, 16),   # noqa: E731
                                   torch.randn(b, 16), torch.randn(b, 5))
    return [Case("diffusers", "DiT (adaLN-Zero, class-conditioned)", dit(), [dit_in(2)], [dit_in(3)]),
            Case("diffusers", "PixArt transformer (adaLN-single, cross-attn)", pix, [pix_in(2)],
                 [pix_in(3, n=7)]),
            Case("diffusers", "Transformer2DModel (continuous, LayerNorm, cross-attn)", t2d, [t2d_in(2)],
                 [t2d_in(3, s=6, n=7)]),
            Case("diffusers", "Transformer2DModel linear projection, self-attn", t2d_lin,
                 [{"hidden_states": torch.randn(2, 16, 8, 8)}], [{"hidden_states": torch.randn(3, 16, 4, 4)}]),
            Case("diffusers", "UNet2DConditionModel (cross-attn blocks)", unet, [unet_in(2)], [unet_in(3, n=7)]),
            Case("diffusers", "SD3 transformer (joint attention, adaLN)", sd3, [sd3_in(2)], [sd3_in(3, n=7)]),
            Case("diffusers", "PriorTransformer (causal, masked, final LayerNorm)", prior, [prior_in(2)],
                 [prior_in(3)]),
            Case("diffusers", "UVit2DModel (RMSNorm, bias-free)", uvit, [uvit_in(2)], [uvit_in(3, s=6, n=7)])]


def lucidrains_cases() -> list[Case]:
    cases = []
    if importlib.util.find_spec("palm_pytorch"):
        from palm_pytorch import PaLM
        cases.append(Case("PaLM-pytorch", "PaLM (parallel block, bias-free LayerNorm)",
                          lambda: PaLM(num_tokens=64, dim=32, depth=2, dim_head=8, heads=2), [ids(2, 12)],
                          [ids(3, 9), ids(1, 20)]))
    if importlib.util.find_spec("perceiver_pytorch"):
        from perceiver_pytorch import Perceiver, PerceiverIO
        cases.append(Case("perceiver-pytorch", "Perceiver (image, latents, cross-attn)",
                          lambda: Perceiver(input_channels=3, input_axis=2, num_freq_bands=4, max_freq=8., depth=2,
                                            num_latents=8, latent_dim=32, cross_heads=1, latent_heads=2,
                                            cross_dim_head=8, latent_dim_head=8, num_classes=10),
                          [torch.randn(2, 8, 8, 3)], [torch.randn(3, 8, 8, 3), torch.randn(1, 6, 10, 3)]))
        cases.append(Case("perceiver-pytorch", "PerceiverIO (masked sequence, queries)",
                          lambda: PerceiverIO(dim=16, queries_dim=16, logits_dim=10, depth=2, num_latents=8,
                                              latent_dim=32, cross_heads=1, latent_heads=2, cross_dim_head=8,
                                              latent_dim_head=8),
                          [(torch.randn(2, 12, 16), torch.ones(2, 12, dtype=torch.bool), torch.randn(2, 5, 16))],
                          [(torch.randn(3, 9, 16), torch.arange(9).expand(3, 9) < torch.tensor([[9], [5], [2]]),
                            torch.randn(3, 4, 16))]))
    if importlib.util.find_spec("tab_transformer_pytorch"):
        from tab_transformer_pytorch import FTTransformer, TabTransformer
        cat = lambda b: torch.stack([torch.randint(0, 3, (b,)), torch.randint(0, 4, (b,))], 1)  # noqa: E731
        cases.append(Case("tab-transformer-pytorch", "FTTransformer",
                          lambda: FTTransformer(categories=(3, 4), num_continuous=5, dim=32, dim_out=1, depth=2,
                                                heads=2, dim_head=8),
                          [(cat(4), torch.randn(4, 5))], [(cat(7), torch.randn(7, 5))]))
        cases.append(Case("tab-transformer-pytorch", "TabTransformer (continuous LayerNorm, MLP head)",
                          lambda: TabTransformer(categories=(3, 4), num_continuous=5, dim=32, dim_out=1, depth=2,
                                                 heads=2, dim_head=8, mlp_hidden_mults=(2, 1),
                                                 mlp_act=nn.ReLU()),
                          [(cat(4), torch.randn(4, 5))], [(cat(7), torch.randn(7, 5))]))
    if importlib.util.find_spec("coca_pytorch"):
        from coca_pytorch import CoCa

        class Patches(nn.Module):   # the image encoder CoCa takes: any (b, n, d) features
            def __init__(self):
                super().__init__()
                self.proj = nn.Conv2d(3, 32, 8, 8)

            def forward(self, x):
                return self.proj(x).flatten(2).transpose(1, 2)
        cases.append(Case("CoCa-pytorch", "CoCa (unimodal + multimodal decoder, attention pooling)",
                          lambda: CoCa(dim=32, img_encoder=Patches(), image_dim=32, num_tokens=64,
                                       unimodal_depth=1, multimodal_depth=1, dim_head=8, heads=2,
                                       num_img_queries=4),
                          [{"text": ids(2, 10), "images": img(2)}], [{"text": ids(3, 7), "images": img(3, 24)}]))
    if importlib.util.find_spec("linformer"):
        from linformer import Linformer, LinformerLM
        cases.append(Case("linformer", "Linformer (fixed length, projected keys)",
                          lambda: Linformer(dim=32, seq_len=16, depth=2, heads=2, k=8), [torch.randn(2, 16, 32)],
                          [torch.randn(3, 16, 32)]))
        cases.append(Case("linformer", "LinformerLM", lambda: LinformerLM(num_tokens=64, dim=32, seq_len=16,
                                                                         depth=2, heads=2, k=8),
                          [ids(2, 16)], [ids(3, 16)]))
    if importlib.util.find_spec("MEGABYTE_pytorch"):
        from MEGABYTE_pytorch import MEGABYTE
        cases.append(Case("MEGABYTE-pytorch", "MEGABYTE (two-level, RMSNorm)",
                          lambda: MEGABYTE(num_tokens=64, dim=(32, 16), depth=(1, 1), max_seq_len=(4, 4),
                                           dim_head=8, heads=2, flash_attn=False),
                          [ids(2, 16)], [ids(3, 12)]))
    return cases


def kornia_cases() -> list[Case]:
    from kornia.models.tiny_vit import TinyViT
    from kornia.models.vit import VisionTransformer
    from kornia.models.vit_mobile import MobileViT

    class Classifier(nn.Module):   # kornia's features, a user's mean-pooled linear head
        def __init__(self):
            super().__init__()
            self.vit = VisionTransformer(image_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2)
            self.head = nn.Linear(32, 10)

        def forward(self, x):
            return self.head(self.vit(x).mean(1))
    return [Case("kornia", "VisionTransformer (features)",
                 lambda: VisionTransformer(image_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2),
                 [img(2)], [img(3)]),
            Case("kornia", "VisionTransformer + a mean-pooled head", Classifier, [img(2)], [img(3)]),
            Case("kornia", "TinyViT (conv stages, windowed attention)",
                 lambda: TinyViT(img_size=64, num_classes=10, embed_dims=[16, 32, 32, 32], depths=[1, 1, 1, 1],
                                 num_heads=[1, 2, 2, 2], window_sizes=[2, 2, 2, 2]),
                 [img(2, 64)], [img(3, 64)]),
            Case("kornia", "MobileViT xxs (unfolded patches, LayerNorm)", lambda: MobileViT(mode="xxs"),
                 [img(2, 64)], [img(3, 64), img(1, 128)])]


def smp_cases() -> list[Case]:
    import segmentation_models_pytorch as smp
    return [Case("segmentation_models_pytorch", "Segformer mit_b0",
                 lambda: smp.Segformer(encoder_name="mit_b0", encoder_weights=None, classes=2), [img(2, 64)],
                 [img(3, 64), img(1, 96)]),
            Case("segmentation_models_pytorch", "Unet mit_b0 encoder",
                 lambda: smp.Unet(encoder_name="mit_b0", encoder_weights=None, classes=2), [img(2, 64)],
                 [img(3, 64), img(1, 96)])]


# libraries issue 48 itself never saw, with the module each case needs (missing: a "not installed" row)
ISSUE48 = {"diffusers": ("diffusers", diffusers_cases), "lucidrains": ("einops", lucidrains_cases),
           "kornia": ("kornia", kornia_cases), "segmentation_models_pytorch": ("segmentation_models_pytorch",
                                                                               smp_cases)}
NOT_TRIED = {"transformer_lens": "4.x dropped HookedTransformer (TransformerBridge wraps transformers models); "
                                 "2.x needs `datasets` (pyarrow, pandas)",
             "litgpt": "`import litgpt.model` imports the package, which needs `lightning`"}


def issue30_cases() -> list[Case]:
    import open_clip.model as oc
    import timm
    from timm.models.metaformer import MetaFormer
    from timm.models.mlp_mixer import MlpMixer
    from torchvision.models import maxvit as tv_maxvit
    from torchvision.models import swin_transformer as tv_swin
    from torchvision.models.vision_transformer import VisionTransformer as TvViT

    def tm(name: str, **kw):
        return lambda: timm.create_model(name, num_classes=10, **kw)
    vit = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2)
    i32 = ([img(2)], [img(3)])
    seq2 = ([(torch.randn(2, 7, 32), torch.randn(2, 5, 32))], [(torch.randn(3, 9, 32), torch.randn(3, 4, 32))])
    text = oc.CLIPTextCfg(context_length=16, vocab_size=100, width=32, heads=2, layers=2)
    models = {
        "timm deit_tiny_distilled": (tm("deit_tiny_distilled_patch16_224", **vit), *i32),
        "timm deit3_small (LayerScale)": (tm("deit3_small_patch16_224", **vit), *i32),
        "timm vit avg pool + fc_norm": (tm("vit_tiny_patch16_224", global_pool="avg", fc_norm=True, **vit), *i32),
        "timm vit registers": (tm("vit_base_patch16_reg4_gap_256", **vit), *i32),
        "timm vit no class token, map head": (tm("vit_tiny_patch16_224", class_token=False, global_pool="map",
                                                 **vit), *i32),
        "timm vit pre-norm (CLIP-style norm_pre)": (tm("vit_base_patch16_clip_224", **vit), *i32),
        "timm vit dynamic size": (tm("vit_small_patch16_224", dynamic_img_size=True, **vit), [img(2)],
                                  [img(3, 48), img(1, 24)]),
        "timm beit": (tm("beit_base_patch16_224", **vit), *i32),
        "timm flexivit": (tm("flexivit_small", **vit), *i32),
        "timm siglip vit": (tm("vit_base_patch16_siglip_224", **vit), *i32),
        "timm dinov2 registers": (tm("vit_small_patch14_reg4_dinov2", img_size=28, patch_size=14, embed_dim=32,
                                     depth=2, num_heads=2), [img(2, 28)], [img(3, 28)]),
        "timm parallel vit": (tm("vit_small_patch16_18x2_224", **vit), *i32),
        "timm cait (class attention)": (tm("cait_xxs24_224", depth_token_only=2, **vit), *i32),
        "timm eva02 small": (tm("eva02_small_patch14_224", img_size=28, patch_size=14, embed_dim=32, depth=2,
                                num_heads=2), [img(2, 28)], [img(3, 28)]),
        "timm pvt_v2": (tm("pvt_v2_b0", embed_dims=(16, 32), depths=(1, 1), num_heads=(1, 2), mlp_ratios=(2, 2),
                           sr_ratios=(2, 1)), *i32),
        "timm swinv2": (tm("swinv2_tiny_window8_256", img_size=32, patch_size=4, window_size=4, embed_dim=16,
                           depths=(1, 1), num_heads=(1, 2)), *i32),
        "timm hiera": (tm("hiera_tiny_224", img_size=64, embed_dim=16, num_heads=1, stages=(1, 1, 1, 1)),
                       [img(2, 64)], [img(3, 64)]),
        "timm twins svt": (tm("twins_svt_small", embed_dims=(16, 32), depths=(1, 1), num_heads=(1, 2),
                              mlp_ratios=(2, 2), sr_ratios=(2, 1), wss=(2, 2)), *i32),
        "timm convnext (LayerNorm2d)": (tm("convnext_atto", dims=(8, 16, 24, 32), depths=(1, 1, 1, 1)), *i32),
        "timm metaformer (pooling)": (lambda: MetaFormer(depths=(1, 1, 1, 1), dims=(8, 16, 24, 32),
                                                         num_classes=10), *i32),
        "timm mixer": (lambda: MlpMixer(num_classes=10, img_size=32, patch_size=8, num_blocks=2, embed_dim=32),
                       *i32),
        "timm xcit": (tm("xcit_nano_12_p16_224", img_size=32, patch_size=16, embed_dim=32, depth=2, num_heads=2,
                         cls_attn_layers=1), *i32),
        "timm maxvit": (tm("maxvit_rmlp_pico_rw_256"), [img(1, 256)], [img(2, 256)]),
        "torchvision vit (class token, 4 layers)": (lambda: TvViT(32, 4, 4, 2, 32, 64, num_classes=10), *i32),
        "torchvision swin v2": (lambda: tv_swin.SwinTransformer([4, 4], 16, [1, 1], [1, 2], [4, 4], num_classes=10,
                                                                block=tv_swin.SwinTransformerBlockV2,
                                                                downsample_layer=tv_swin.PatchMergingV2), *i32),
        "torchvision maxvit": (lambda: tv_maxvit.MaxVit((32, 32), 8, 2, [16, 32], [1, 1], 8, 0.0, num_classes=10),
                               *i32),
        "open_clip CLIP, no LayerScale": (lambda: oc.CLIP(16, oc.CLIPVisionCfg(layers=2, width=32, head_width=16,
                                                                               patch_size=8, image_size=32), text),
                                          [(img(2), ids(2, 16, 100))], [(img(3), ids(3, 16, 100))]),
        "open_clip visual tower, LayerScale": (lambda: oc.CLIP(16, oc.CLIPVisionCfg(
            layers=2, width=32, head_width=16, patch_size=8, image_size=32, ls_init_value=0.5), text).visual, *i32),
        "nn.Transformer norm_first, 2+2 layers": (lambda: nn.Transformer(32, 2, 2, 2, 64, dropout=0.0,
                                                                         batch_first=True, norm_first=True), *seq2),
        "nn.TransformerDecoder norm_first, final norm": (
            lambda: nn.TransformerDecoder(nn.TransformerDecoderLayer(32, 2, 64, dropout=0.0, batch_first=True,
                                                                     norm_first=True), 2, norm=nn.LayerNorm(32)),
            *seq2),
        "nn.TransformerEncoder post-LN": (
            lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True), 2,
                                          enable_nested_tensor=False),
            [torch.randn(2, 7, 32)], [torch.randn(3, 9, 32)]),
    }
    return [Case(name.split()[0], name, *spec) for name, spec in models.items()]


def engine_cases() -> list[Case]:
    """The real models issue 48's engine items were checked on by hand (vit-pytorch's CaiT: item 1; MONAI's ViT:
    item 6; timm's EfficientFormer: item 7; MONAI's SwinUNETR: item 5)."""
    import timm
    from monai.networks.nets import ViT, SwinUNETR
    from vit_pytorch.cait import CaiT

    cait = dict(image_size=32, patch_size=8, num_classes=10, dim=32, depth=2, cls_depth=1, heads=2, mlp_dim=64,
                dim_head=16)
    models = {
        "vit-pytorch CaiT (LayerScale (1, 1, D))": (lambda: CaiT(**cait), [img(2)], [img(3)]),
        "monai ViT (norm_cross_attn built, switched off)": (
            lambda: ViT(1, (16, 16, 16), (8, 8, 8), hidden_size=32, mlp_dim=64, num_layers=2, num_heads=2),
            [torch.randn(2, 1, 16, 16, 16)], [torch.randn(3, 1, 16, 16, 16)]),
        "timm EfficientFormer (MetaFormer stages, then pre-LN)": (
            lambda: timm.create_model("efficientformer_l1", num_classes=10, embed_dims=(8, 16, 24, 32),
                                      depths=(1, 1, 1, 2), num_vit=1), [img(2, 224)], [img(1, 224)]),
        "monai SwinUNETR (F.layer_norm of the stream)": (
            lambda: SwinUNETR(1, 2, depths=(1, 1, 1, 1), num_heads=(1, 1, 2, 2), feature_size=12, spatial_dims=2),
            [img(2, 64, 1)], [img(1, 96, 1)]),
    }
    return [Case(name.split()[0], name, *spec) for name, spec in models.items()]


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def rows_of(name: str, needs: str, cases: Callable[[], list[Case]], only: str | None, exports: bool) -> list[Row]:
    if importlib.util.find_spec(needs) is None:
        return [Row(name, "-", "not installed", f"`{needs}` is not importable")]
    try:
        built = cases()
    except ImportError as e:
        return [Row(name, "-", "not installed", first_line(e))]
    return [judge(c, exports) for c in built if only is None or only.lower() in (c.library + c.name).lower()]


def table(rows: list[Row]) -> str:
    lines = ["| library | model | result | detail | ONNX | save + restore |", "|---|---|---|---|---|---|"]
    lines += [f"| {r.library} | {r.model} | {r.result} | {r.detail.replace('|', '/')} | "
              f"{r.onnx.replace('|', '/')} | {r.restore.replace('|', '/')} |" for r in rows]
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.result] = counts.get(r.result, 0) + 1
    return "\n".join(lines) + "\n\n" + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--set", choices=("issue48", "issue30", "engine"), default="issue48")
    p.add_argument("--only", help="only the models whose library + name contains this word")
    p.add_argument("--no-exports", action="store_true", help="skip export_onnx and save + restore")
    p.add_argument("--out", type=Path, help="folder for third_party.md and third_party.json")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    libs = {"issue30": {"timm, torchvision, open_clip, torch.nn": ("timm", issue30_cases)}, "issue48": ISSUE48,
            "engine": {"vit-pytorch, monai, timm": ("monai", engine_cases)}}[a.set]
    dists = ["torch", "onnxruntime", *(["vit-pytorch", "monai", "timm"] if a.set == "engine" else
                                       [] if a.set == "issue30" else
                                       ["diffusers", "einops", "PaLM-pytorch", "perceiver-pytorch",
                                        "tab-transformer-pytorch", "CoCa-pytorch", "linformer", "MEGABYTE-pytorch",
                                        "kornia", "segmentation_models_pytorch"])]
    head = (f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
            + ", ".join(f"{d} {version(d)}" for d in dists))
    print(head, flush=True)
    rows = []
    for name, (needs, cases) in libs.items():
        for row in rows_of(name, needs, cases, a.only, not a.no_exports):
            rows.append(row)
            print(f"{row.library} | {row.model} | {row.result} | {row.detail} | {row.onnx} | {row.restore} "
                  f"({row.seconds}s)", flush=True)
    if a.set == "issue48" and a.only is None:
        rows += [Row(lib, "-", "not tried", why) for lib, why in NOT_TRIED.items()]
    md = f"{head}\n\n{table(rows)}"
    print("\n" + md)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "third_party.md").write_text(md)
        (a.out / "third_party.json").write_text(json.dumps({"header": head, "rows": [asdict(r) for r in rows]},
                                                           indent=1))
    return 1 if any(r.result in ("WRONG", "CRASH") or r.onnx.startswith(("CRASH", "WRONG")) or
                    r.restore.startswith(("CRASH", "WRONG")) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
