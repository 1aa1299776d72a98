"""Exact conversion of third-party model code through the plain API with `example_inputs` (issue 30).

Tiny models from timm, torchvision, open_clip and torch.nn, other than the ones `tests/surgery/
test_third_party_models.py` holds, with perturbed norm gains and biases (LayerScale gains too). Each is
converted with `normswap.convert(model, method="exact", example_inputs=...)`, then judged on inputs other
than the examples (another batch size and, where the model takes it, another image size or length):

    exact      every LayerNorm converted, outputs within 1e-5 (relative to each output's largest value)
    kept       exact, some norms kept as LayerNorms (named by the report)
    none       nothing to convert (channels-first LayerNorm2d and the like: left alone, model unchanged)
    refused    a NormswapError (its first line printed), the model untouched
    WRONG      converted, but the outputs on the other inputs differ: the failure this table exists for
    error      any other exception out of normswap

Run: `.venv/bin/python benchmarks/third_party.py` (about 2 minutes on 2 CPU cores).
"""
from __future__ import annotations

import sys
import time

import open_clip.model as oc
import timm
from timm.models.metaformer import MetaFormer
from timm.models.mlp_mixer import MlpMixer
import torch
from torch import nn
from torchvision.models import maxvit as tv_maxvit
from torchvision.models import swin_transformer as tv_swin
from torchvision.models.vision_transformer import VisionTransformer

import normswap
from normswap.errors import NormswapError
from normswap.parity import tensors_in

TOL = 1e-5


def img(b: int, size: int = 32) -> torch.Tensor:
    return torch.randn(b, 3, size, size)


def ids(b: int, t: int, vocab: int = 100) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t))


def perturbed(model: nn.Module) -> nn.Module:
    """Norm gains and biases away from 1 and 0, LayerScale gains away from their tiny init, zero-initialised
    weights (classifier heads) random: as trained."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            for pname, p in module.named_parameters(recurse=False):
                if isinstance(module, nn.LayerNorm) or "Norm" in type(module).__name__ and p.dim() == 1:
                    p.copy_((pname == "weight") + 0.3 * torch.randn(p.shape, generator=g))
                elif p.dim() == 1 and pname in ("gamma", "gamma_1", "gamma_2", "scale"):
                    p.copy_(0.5 + 0.3 * torch.randn(p.shape, generator=g))
                elif p.dim() > 1 and not p.any():   # a zero-init head: every output would be 0, judging nothing
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


def tm(name: str, **kw):
    return lambda: timm.create_model(name, num_classes=10, **kw)


VIT = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2)
I32 = ([img(2)], [img(3)])

# name -> (build, example_inputs, other inputs)
MODELS = {
    "timm deit_tiny_distilled": (tm("deit_tiny_distilled_patch16_224", **VIT), *I32),
    "timm deit3_small (LayerScale)": (tm("deit3_small_patch16_224", **VIT), *I32),
    "timm vit avg pool + fc_norm": (tm("vit_tiny_patch16_224", global_pool="avg", fc_norm=True, **VIT), *I32),
    "timm vit registers": (tm("vit_base_patch16_reg4_gap_256", **VIT), *I32),
    "timm vit no class token, map head": (tm("vit_tiny_patch16_224", class_token=False, global_pool="map", **VIT),
                                          *I32),
    "timm vit pre-norm (CLIP-style norm_pre)": (tm("vit_base_patch16_clip_224", **VIT), *I32),
    "timm vit dynamic size": (tm("vit_small_patch16_224", dynamic_img_size=True, **VIT), [img(2)],
                              [img(3, 48), img(1, 24)]),
    "timm beit": (tm("beit_base_patch16_224", **VIT), *I32),
    "timm flexivit": (tm("flexivit_small", **VIT), *I32),
    "timm siglip vit": (tm("vit_base_patch16_siglip_224", **VIT), *I32),
    "timm dinov2 registers": (tm("vit_small_patch14_reg4_dinov2", img_size=28, patch_size=14, embed_dim=32,
                                 depth=2, num_heads=2), [img(2, 28)], [img(3, 28)]),
    "timm parallel vit": (tm("vit_small_patch16_18x2_224", **VIT), *I32),
    "timm cait (class attention)": (tm("cait_xxs24_224", depth_token_only=2, **VIT), *I32),
    "timm eva02 small": (tm("eva02_small_patch14_224", img_size=28, patch_size=14, embed_dim=32, depth=2,
                            num_heads=2), [img(2, 28)], [img(3, 28)]),
    "timm pvt_v2": (tm("pvt_v2_b0", embed_dims=(16, 32), depths=(1, 1), num_heads=(1, 2), mlp_ratios=(2, 2),
                       sr_ratios=(2, 1)), *I32),
    "timm swinv2": (tm("swinv2_tiny_window8_256", img_size=32, patch_size=4, window_size=4, embed_dim=16,
                       depths=(1, 1), num_heads=(1, 2)), *I32),
    "timm hiera": (tm("hiera_tiny_224", img_size=64, embed_dim=16, num_heads=1, stages=(1, 1, 1, 1)),
                   [img(2, 64)], [img(3, 64)]),
    "timm twins svt": (tm("twins_svt_small", embed_dims=(16, 32), depths=(1, 1), num_heads=(1, 2),
                          mlp_ratios=(2, 2), sr_ratios=(2, 1), wss=(2, 2)), *I32),
    "timm convnext (LayerNorm2d)": (tm("convnext_atto", dims=(8, 16, 24, 32), depths=(1, 1, 1, 1)), *I32),
    "timm metaformer (pooling)": (lambda: MetaFormer(depths=(1, 1, 1, 1), dims=(8, 16, 24, 32), num_classes=10),
                                  *I32),
    "timm mixer": (lambda: MlpMixer(num_classes=10, img_size=32, patch_size=8, num_blocks=2, embed_dim=32), *I32),
    "timm xcit": (tm("xcit_nano_12_p16_224", img_size=32, patch_size=16, embed_dim=32, depth=2, num_heads=2,
                     cls_attn_layers=1), *I32),
    "timm maxvit": (tm("maxvit_rmlp_pico_rw_256"), [img(1, 256)], [img(2, 256)]),
    "torchvision vit (class token, 4 layers)": (lambda: VisionTransformer(32, 4, 4, 2, 32, 64, num_classes=10),
                                                *I32),
    "torchvision swin v2": (lambda: tv_swin.SwinTransformer([4, 4], 16, [1, 1], [1, 2], [4, 4], num_classes=10,
                                                            block=tv_swin.SwinTransformerBlockV2,
                                                            downsample_layer=tv_swin.PatchMergingV2), *I32),
    "torchvision maxvit": (lambda: tv_maxvit.MaxVit((32, 32), 8, 2, [16, 32], [1, 1], 8, 0.0, num_classes=10),
                           *I32),
    "open_clip CLIP, no LayerScale": (lambda: oc.CLIP(16, oc.CLIPVisionCfg(layers=2, width=32, head_width=16,
                                                                           patch_size=8, image_size=32),
                                                      oc.CLIPTextCfg(context_length=16, vocab_size=100, width=32,
                                                                     heads=2, layers=2)),
                                      [(img(2), ids(2, 16))], [(img(3), ids(3, 16))]),
    "open_clip visual tower, LayerScale": (lambda: oc.CLIP(16, oc.CLIPVisionCfg(layers=2, width=32, head_width=16,
                                                                                patch_size=8, image_size=32,
                                                                                ls_init_value=0.5),
                                                           oc.CLIPTextCfg(context_length=16, vocab_size=100,
                                                                          width=32, heads=2, layers=2)).visual,
                                           *I32),
    "nn.Transformer norm_first, 2+2 layers": (lambda: nn.Transformer(32, 2, 2, 2, 64, dropout=0.0, batch_first=True,
                                                                     norm_first=True),
                                              [(torch.randn(2, 7, 32), torch.randn(2, 5, 32))],
                                              [(torch.randn(3, 9, 32), torch.randn(3, 4, 32))]),
    "nn.TransformerDecoder norm_first, final norm": (
        lambda: nn.TransformerDecoder(nn.TransformerDecoderLayer(32, 2, 64, dropout=0.0, batch_first=True,
                                                                 norm_first=True), 2, norm=nn.LayerNorm(32)),
        [(torch.randn(2, 7, 32), torch.randn(2, 5, 32))], [(torch.randn(3, 9, 32), torch.randn(3, 4, 32))]),
    "nn.TransformerEncoder post-LN": (
        lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True), 2,
                                      enable_nested_tensor=False),
        [torch.randn(2, 7, 32)], [torch.randn(3, 9, 32)]),
}


def call(model: nn.Module, batch) -> list[torch.Tensor]:
    with torch.no_grad():
        out = model(*batch) if isinstance(batch, tuple) else model(batch)
    return [t.double() for t in tensors_in(out) if t.is_floating_point()]


def worst(model: nn.Module, others: list, refs: list) -> float:
    return max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
               for x, ref in zip(others, refs) for a, b in zip(call(model, x), ref))


def judge(build, examples, others) -> tuple[str, str]:
    torch.manual_seed(0)
    try:
        model = perturbed(build())
        refs = [call(model, x) for x in others]
    except Exception as e:   # the library's own code on these tiny settings: not a normswap result
        return "unbuilt", f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"
    before = sum(isinstance(m, nn.LayerNorm) for m in model.modules())
    try:
        report = normswap.convert(model, method="exact", example_inputs=examples)
    except NormswapError as e:
        return "refused", str(e).splitlines()[0][:160]
    except Exception as e:
        return "error", f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    err = worst(model, others, refs)
    if err > TOL:
        return "WRONG", f"converted {report.num_converted}, but {err:.2e} off on other inputs"
    if not report.num_converted:
        return "none", f"{before} LayerNorm(s) before; nothing converted; {err:.1e}"
    kept = len(report.skipped)
    return ("kept" if kept else "exact"), f"{report.num_converted} converted, {kept} kept, max rel {err:.1e}"


def main() -> int:
    print(f"torch {torch.__version__}, timm {timm.__version__}, open_clip {oc.__name__.split('.')[0]}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    counts: dict[str, int] = {}
    print(f"| {'model':44} | result | detail |\n|---|---|---|")
    for name, (build, examples, others) in MODELS.items():
        kind, detail = judge(build, examples, others)
        counts[kind] = counts.get(kind, 0) + 1
        print(f"| {name:44} | {kind} | {detail} |", flush=True)
    print("\n" + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    return 1 if counts.get("WRONG") or counts.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
