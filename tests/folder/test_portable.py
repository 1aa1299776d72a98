"""The shipped modeling file (`normswap/folder/portable.py`): its norms export with a user's own tools (issue 33.3);
what every load prints (its `not_preserved` entries) is plain text (issue 33.20)."""
from __future__ import annotations

import json
import warnings

import pytest
import torch

import normswap
from normswap.folder import portable, schema, fixes

from helpers.export_models import converted as naive_conversion


def bits_pow2_floor(m: torch.Tensor) -> torch.Tensor:
    """The mantissa-clearing form the file used before (a bit-cast no exporter takes)."""
    return (m.view(torch.int32) & 0x7F800000).view(torch.float32).clamp(min=1.0)


def test_pow2_floor_is_the_largest_power_of_two_below():
    """The same power of two the bit-cast gave, for every exponent, at and beside each power of two."""
    e = torch.arange(-149, 128, dtype=torch.float64)
    p = torch.pow(2.0, e).float()
    m = torch.cat([p, torch.nextafter(p, torch.tensor(0.0)), torch.nextafter(p, torch.tensor(float("inf"))),
                   p * 1.5, torch.rand(10000) * torch.pow(2.0, torch.randint(-100, 127, (10000,))).float(),
                   torch.tensor([0.0, 1.0, torch.finfo(torch.float32).max, float("inf")])])
    assert torch.equal(portable.pow2_floor(m), bits_pow2_floor(m))


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
def test_shipped_norms_export_with_torch_onnx(tmp_path, dynamo):
    """torch.onnx.export of the shipped RMSNorm and pRMSNorm (as a user exports a plain-loaded folder) runs in
    onnxruntime and gives the module's values; both exporters refused view(torch.int32) before."""
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    model = torch.nn.Sequential(portable.RMSNorm(16, eps=1e-5), portable.PartialRMSNorm(16, eps=1e-5, p=0.25)).eval()
    with torch.no_grad():
        for norm in model:
            norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 5, 16) * 3 + 1
    file = tmp_path / "norm.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), str(file), dynamo=dynamo, input_names=["x"])
    y = ort.InferenceSession(str(file)).run(None, {"x": x.numpy()})[0]
    torch.testing.assert_close(torch.from_numpy(y), model(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("entry", [{"logits\x1b[2J": "why"}, {"logits": "why\nwarning: fake"}])
def test_not_preserved_entries_must_be_printable(tmp_path, entry):
    normswap.save_pretrained(naive_conversion("gpt2"), tmp_path / "m")
    section = json.loads((tmp_path / "m" / "config.json").read_text())["normswap"]
    portable.validate(section, "m")
    with pytest.raises(portable.InvalidConversion, match="not_preserved must map output names to reasons"):
        portable.validate({**section, "not_preserved": entry}, "m")


def test_an_output_fix_key_the_format_does_not_define_is_refused(tmp_path):
    """A matrix fix needs format 3 or later (format 2 readers, which ignored unknown keys, refuse format 3 in one
    line); an unknown key is refused in every format rather than ignored (the model would be another); a format
    this version does not know is refused."""
    normswap.save_pretrained(naive_conversion("gpt2"), tmp_path / "m")
    section = json.loads((tmp_path / "m" / "config.json").read_text())["normswap"]
    assert section["format"] == 4 == schema.FORMAT
    matrix = {**section, "output_fixes": {"transformer.ln_f": {"centre": False, "bias": 0, "matrix": 32}}}
    for fmt in (3, 4):
        portable.validate({**matrix, "format": fmt}, "m")
    with pytest.raises(portable.InvalidConversion, match=r"output_fixes\['transformer.ln_f'\]\.matrix is not in "
                                                          r"format 2 \(a newer normswap's\?\)"):
        portable.validate({**matrix, "format": 2}, "m")
    unknown = {**matrix, "output_fixes": {"transformer.ln_f": {"centre": False, "bias": 0, "scale": 2}}}
    with pytest.raises(portable.InvalidConversion, match=r"\.scale is not in format 4"):
        portable.validate(unknown, "m")
    with pytest.raises(portable.InvalidConversion, match="normswap format 5 is not supported"):
        portable.validate({**matrix, "format": 5}, "m")


def test_an_online_rotation_needs_format_4_and_a_width_of_its_factor_times_a_power_of_two(tmp_path):
    """Format 3's readers refuse the keys (as format 4's before online rotations do: unknown keys); a width that is
    not the factor's side times a power of two would not rebuild the transform."""
    normswap.save_pretrained(naive_conversion("gpt2"), tmp_path / "m")
    section = json.loads((tmp_path / "m" / "config.json").read_text())["normswap"]

    def online(n, m, fmt=4):
        return {**section, "format": fmt, "output_fixes": {"transformer.h.0.mlp.c_proj": {
            "centre": False, "bias": 0, "online": n, "online_factor": m}}}
    for n, m in ((128, 128), (128, 1), (48, 12), (96, 12)):
        portable.validate(online(n, m), "m")
    with pytest.raises(portable.InvalidConversion, match=r"\.online is not in format 3"):
        portable.validate(online(48, 12, 3), "m")
    for n, m in ((36, 12), (48, 10), (8, 12), (48, 0)):
        with pytest.raises(portable.InvalidConversion, match=f"online rotation of width {n} with a {m} x {m} factor"):
            portable.validate(online(n, m), "m")
    with pytest.raises(portable.InvalidConversion, match=r"online_factor = True is not an integer"):
        portable.validate(online(48, True), "m")


def test_a_matrix_fix_multiplies_after_centring_and_before_the_bias():
    """out = centre(out) @ M + b; an input fix: centre(x) @ M."""
    layer = torch.nn.Linear(4, 4)
    m, b = torch.randn(4, 4), torch.randn(4)
    fixes.add_output_fix(layer, True, b, matrix=m)
    x = torch.randn(3, 4)
    y = layer.weight @ x.T
    want = (y.T + layer.bias - (y.T + layer.bias).mean(-1, keepdim=True)) @ m + b
    torch.testing.assert_close(layer(x), want)
    assert fixes.fixed(x, False, None, m).equal(x @ m)
    fresh = torch.nn.Linear(4, 4)   # as loading builds it: zeros the weights fill
    fixes.add_output_fix(fresh, False, width=4, side=4)
    assert fresh.normswap_matrix.shape == (4, 4) and not fresh.normswap_matrix.any()
    block = torch.nn.Identity()   # an input fix: centred, then times its matrix (a rotated entry)
    fixes.add_input_fix(block, side=4)
    block.normswap_input_matrix.data.copy_(m)
    torch.testing.assert_close(block(x), (x - x.mean(-1, keepdim=True)) @ m)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_centring_mean_is_exact_to_its_dtype(dtype):
    """Rows minus their mean: the mean in fp32 (fp64 for fp64), the difference in x's dtype; fp16 rows of 4096
    values near 60000 would overflow a sum in fp16."""
    x = (torch.randn(5, 4096, dtype=torch.float64) * 3 + 7) * (60000 / 16 if dtype == torch.float16 else 1)
    x = x.clamp(-65000, 65000).to(dtype)
    want = x.double() - x.double().mean(-1, keepdim=True)
    got = fixes.centred(x)
    assert got.dtype == dtype
    err = ((got.double() - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
    # fp64: the old fp32 mean left ~1e-8 of each row's mean behind; in fp64 it is ~1e-16
    assert err < {torch.float64: 1e-14, torch.float32: 1e-6}.get(dtype, 1e-2), err


def test_an_output_fix_without_bias_or_matrix_only_centres():
    """A centring-only fix (a tied embedding's) has no normswap_bias / normswap_matrix and returns centre(out)."""
    emb = torch.nn.Embedding(10, 8)
    fixes.add_output_fix(emb, True)
    assert "normswap_bias" not in dict(emb.named_parameters()) and "normswap_matrix" not in dict(emb.named_parameters())
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(emb(ids), emb.weight[ids] - emb.weight[ids].mean(-1, keepdim=True))


class Tied(torch.nn.Module):
    """An embedding and a head sharing one weight (picklable: a module-level class)."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(10, 8), torch.nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.emb(ids))


def _no_hooks(module: torch.nn.Module) -> bool:
    return not any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


def fixed_tied() -> tuple[Tied, torch.Tensor]:
    """`Tied` with every kind of fix: its embedding centred, its head's input centred and a bias added after it;
    and what it returns for ids [[1, 2, 3]] (the expected values)."""
    model, ids = Tied(), torch.tensor([[1, 2, 3]])
    fixes.add_output_fix(model.emb, True)
    fixes.add_input_fix(model.head)
    fixes.add_output_fix(model.head, False, torch.randn(10))
    w = model.emb.weight.detach()
    e = w[ids] - w[ids].mean(-1, keepdim=True)
    return model, (e - e.mean(-1, keepdim=True)) @ w.T + model.head.normswap_bias.detach()


def test_fixes_are_the_modules_own_forward_not_hooks():
    """A fixed module keeps its instance, class name, isinstance, parameters (a tie too) and state dict; its fixes
    run in its own forward (no hook), through deepcopy and pickle."""
    import copy
    import pickle

    keys, ids = list(Tied().state_dict()), torch.tensor([[1, 2, 3]])
    model, want = fixed_tied()
    assert isinstance(model.emb, torch.nn.Embedding) and type(model.emb).__name__ == "Embedding"
    assert type(model.head) is fixes.fixed_class(torch.nn.Linear, True, True) and _no_hooks(model)
    assert model.head.weight is model.emb.weight and list(model.state_dict()) == [*keys, "head.normswap_bias"]
    with torch.no_grad():
        torch.testing.assert_close(model(ids), want)
        for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            assert type(other.head) is type(model.head) and other.head.weight is other.emb.weight
            assert torch.equal(other(ids), model(ids)) and _no_hooks(other)


@pytest.mark.slow
def test_fixed_modules_compile_and_export():
    model, want = fixed_tied()
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, fullgraph=True)(ids), want)
        torch.testing.assert_close(torch.export.export(model, (ids,)).module()(ids), want)


def test_an_input_fix_centres_a_keyword_argument_by_the_original_signature():
    """Called with keywords only, the input fix centres the first tensor in the original forward's order."""
    class Block(torch.nn.Module):
        def forward(self, hidden, mask=None):
            return hidden if mask is None else hidden * mask

    block = Block()
    fixes.add_input_fix(block)
    x, mask = torch.randn(2, 4), torch.rand(2, 4)
    torch.testing.assert_close(block(mask=mask, hidden=x), (x - x.mean(-1, keepdim=True)) * mask)
