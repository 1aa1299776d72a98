"""Real third-party code (timm, torchvision, open_clip, torch.nn, hand-written GPTs), tiny and with perturbed
norms, converted exactly through the plain API with `example_inputs`, then judged on other inputs (batch sizes,
lengths, image sizes); and the ones no exact form exists for, refused with the true reason."""
from __future__ import annotations

import open_clip.model as oc
import pytest
import timm
import torch
from helpers.user_models import GPT
from torch import nn
from torchvision.models.swin_transformer import SwinTransformer
from torchvision.models.vision_transformer import VisionTransformer

import normswap
from normswap.parity import tensors_in
from normswap.surgery.labels import Cause, NotExact
from normswap.surgery.walk import Skip

pytestmark = pytest.mark.slow   # timm, torchvision and open_clip models, traced and verified


VIT = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=10)


def img(b: int, size: int = 32) -> torch.Tensor:
    return torch.randn(b, 3, size, size)


def ids(b: int, t: int, vocab: int = 61) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t))


def perturbed(model: nn.Module) -> nn.Module:
    """Norm gains and biases away from 1 and 0, LayerScale gains away from their tiny init (as trained)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            for pname, p in module.named_parameters(recurse=False):
                if isinstance(module, nn.LayerNorm):
                    p.copy_((pname == "weight") + 0.3 * torch.randn(p.shape, generator=g))
                elif p.dim() == 1 and pname in ("gamma", "gamma_1", "gamma_2"):
                    p.copy_(0.5 + 0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


def encoder(norm_first: bool, final: bool = True) -> nn.Module:
    layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True, norm_first=norm_first)
    return nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(32) if final else None, enable_nested_tensor=False)


def clip(ls: float | None = 0.5) -> nn.Module:
    return oc.CLIP(16, oc.CLIPVisionCfg(layers=2, width=32, head_width=16, patch_size=8, image_size=32,
                                        ls_init_value=ls),
                   oc.CLIPTextCfg(context_length=16, vocab_size=100, width=32, heads=2, layers=2, ls_init_value=ls))


def tv_vit() -> nn.Module:
    model = VisionTransformer(32, 8, 2, 2, 32, 64, num_classes=10)
    nn.init.normal_(model.heads.head.weight)   # torchvision zero-inits its head: every output would be 0
    return model


class ParallelBlock(nn.Module):
    """GPT-J's block: attention and MLP read one norm's output, both write the stream."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.ln, self.attn = nn.LayerNorm(d), nn.MultiheadAttention(d, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 64), nn.GELU(), nn.Linear(64, d))

    def forward(self, x):
        h = self.ln(x)
        return x + self.attn(h, h, h, need_weights=False)[0] + self.mlp(h)


class GPTJ(nn.Module):
    def __init__(self, d: int = 32):
        super().__init__()
        self.emb, self.blocks = nn.Embedding(61, d), nn.Sequential(ParallelBlock(), ParallelBlock())
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, 61)

    def forward(self, idx):
        return self.head(self.ln_f(self.blocks(self.emb(idx))))


# name -> (build, example_inputs, other inputs judged on, norms kept as LayerNorm (exact for the rest))
EXACT = {
    "timm_vit_any_size": (lambda: timm.create_model("vit_tiny_patch16_224", dynamic_img_size=True, **VIT),
                          [img(2)], [img(3, 48), img(1, 24)], 0),
    "timm_cait": (lambda: timm.create_model("cait_xxs24_224", depth_token_only=1, **VIT), [img(2)], [img(3)], 0),
    "timm_eva02": (lambda: timm.create_model("eva02_tiny_patch14_224", img_size=28, patch_size=14, embed_dim=32,
                                             depth=2, num_heads=2, num_classes=10), [img(2, 28)], [img(3, 28)], 0),
    "timm_swin": (lambda: timm.create_model("swin_tiny_patch4_window7_224", img_size=32, patch_size=4, window_size=4,
                                            embed_dim=16, depths=(1, 1), num_heads=(1, 2), num_classes=10),
                  [img(2)], [img(3)], 4),
    "torchvision_vit": (lambda: tv_vit(), [img(2)], [img(5)], 0),
    "torchvision_swin": (lambda: SwinTransformer([4, 4], 16, [1, 1], [1, 2], [4, 4], num_classes=10),
                         [img(2)], [img(3)], 4),
    "open_clip_layerscale": (clip, [(img(2), ids(2, 16, 100))], [(img(3), ids(3, 16, 100))], 0),
    "nn_transformer_norm_first": (lambda: nn.Transformer(32, 2, 1, 1, 64, dropout=0.0, batch_first=True,
                                                         norm_first=True),
                                  [(torch.randn(2, 8, 32), torch.randn(2, 5, 32))],
                                  [(torch.randn(3, 11, 32), torch.randn(3, 2, 32))], 0),
    "nn_encoder_norm_first": (lambda: encoder(True), [torch.randn(2, 8, 32)], [torch.randn(4, 13, 32)], 0),
    "hand_gpt": (GPT, [ids(2, 16), (ids(1, 4), torch.randn(1, 8))], [ids(3, 40), ids(1, 64)], 0),
    "hand_gptj": (GPTJ, [ids(2, 8)], [ids(3, 19)], 0),
}


def call(model, batch):
    with torch.no_grad():
        out = model(*batch) if isinstance(batch, tuple) else model(batch)
    return [t.double() for t in tensors_in(out) if t.is_floating_point()]


@pytest.mark.parametrize("name", sorted(EXACT))
def test_converts_exactly_and_holds_on_other_inputs(name):
    build, examples, others, kept = EXACT[name]
    torch.manual_seed(0)
    model = perturbed(build())
    refs = [call(model, x) for x in others]
    report = normswap.convert(model, method="exact", example_inputs=examples)
    assert report.method == "exact" and report.num_converted > 0
    assert len(report.skipped) == kept, report.skipped
    assert sum(isinstance(m, nn.LayerNorm) for m in model.modules()) == kept
    for x, ref in zip(others, refs):
        got = call(model, x)
        assert len(got) == len(ref)
        for a, b in zip(got, ref):
            assert ((a - b).abs().max() / b.abs().max()).item() < 1e-5


REFUSED = {
    "nn_encoder_post_ln": (lambda: encoder(False), torch.randn(2, 8, 32), Cause.POST_LN),
    "nn_encoder_returns_the_stream": (lambda: encoder(True, final=False), torch.randn(2, 8, 32), Cause.STREAM),
    "open_clip_text_tower_returns_the_stream": (lambda: clip().transformer, torch.randn(2, 16, 32), Cause.STREAM),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_with_the_true_reason_and_untouched(name):
    build, x, cause = REFUSED[name]
    torch.manual_seed(0)
    model = perturbed(build())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(NotExact) as e:
        normswap.convert(model, method="exact", example_inputs=x)
    assert e.value.cause is cause
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_channels_first_layernorm2d_is_left_alone():
    """ConvNeXt's LayerNorm2d normalises channels of (B, C, H, W): not a last-dim norm; nothing else to convert."""
    torch.manual_seed(0)
    model = perturbed(timm.create_model("convnext_atto", dims=(8, 16, 24, 32), depths=(1, 1, 1, 1), num_classes=10))
    x = img(2)
    ref = call(model, x)
    report = normswap.convert(model, method="exact", example_inputs=img(1))
    assert not report.converted and report.skipped
    assert all(s.cause is Skip.NOT_NORM for s in report.skipped)
    assert all(torch.equal(a, b) for a, b in zip(call(model, x), ref))


def test_depthwise_conv_writing_the_stream_keeps_the_norms_it_reaches():
    """Twins' conditional position encoding: a depthwise conv of the stream added back; its norms stay LayerNorm,
    named with why, and the model is still exact."""
    torch.manual_seed(0)
    model = perturbed(timm.create_model("twins_pcpvt_small", embed_dims=(16, 32), depths=(1, 1), num_heads=(1, 2),
                                        sr_ratios=(2, 1), mlp_ratios=(2, 2), num_classes=10))
    x = img(3)
    ref = call(model, x)
    report = normswap.convert(model, method="exact", example_inputs=img(2))
    kept = {s.name: s.reason for s in report.skipped}
    assert "read directly by pos_block.1.proj.0 (Conv2d)" in kept["patch_embeds.1.norm"]
    assert max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(call(model, x), ref)) < 1e-5


class RawHead(nn.Module):
    """A pre-LN block whose classifier reads the raw stream, not a final norm."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.emb, self.ln, self.fc, self.head = nn.Embedding(20, d), nn.LayerNorm(d), nn.Linear(d, d), nn.Linear(d, 3)

    def forward(self, idx):
        x = self.emb(idx)
        x = x + self.fc(self.ln(x))
        return self.head(x)


def test_a_head_reading_the_raw_stream_is_refused_naming_it():
    with pytest.raises(NotExact) as e:
        normswap.convert(perturbed(RawHead()), method="exact", example_inputs=ids(2, 5, 20))
    assert e.value.cause is Cause.READ and "head (Linear)" in str(e.value)
