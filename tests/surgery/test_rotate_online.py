"""Online rotations (QuaRot's R4, `rotate(..., online=True)`): the transform against its dense matrix in float64, the
layers found by behaviour (each MLP's down projection, never an attention's output), outputs kept on other inputs,
what the report and the section record, refusals named."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import normswap
from normswap.errors import NormswapError
from normswap.folder.fixes import online_rotated
from normswap.parity import compare
from normswap.surgery.orthogonal import _sylvester, online_factors
from normswap.surgery.rotate import NotRotatable, rotate
from helpers.exact_models import build, padded_batches
from helpers.user_models import perturbed
from surgery.test_rotate import LinearGPT
from surgery.test_rotate_rmsnorm import rel, tiny


def dense(signs: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """The matrix the transform applies, built the slow way: diag(signs)·(Sylvester ⊗ F), rows of norm 1."""
    p = signs.numel() // factor.shape[0]
    h = torch.kron(_sylvester(p), factor.double())
    return signs.double()[:, None] * h / h[0].norm()


@pytest.mark.parametrize("n,method,what", [(1536, "hadamard", "fast transform 128 x 12"),
                                           (48, "hadamard", "fast transform 4 x 12"),
                                           (64, "hadamard", "fast transform 64"),
                                           (20, "hadamard", "fast transform 1 x 20"),
                                           (14, "hadamard", "no Hadamard of order 14 known"),
                                           (48, "random", "dense 48 x 48")])
def test_the_transform_is_its_dense_orthogonal_matrix_in_float64(n, method, what):
    signs, factor, described = online_factors(n, method, torch.Generator().manual_seed(n))
    assert what in described
    h = dense(signs, factor)
    assert (h @ h.T - torch.eye(n, dtype=torch.float64)).abs().max() < 1e-12
    x = torch.randn(2, 3, n, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert rel(online_rotated(x, signs, factor), x @ h) < 1e-13
    if method == "hadamard" and "known" not in described:   # ±1 signs, a ±1 factor: exact in any dtype
        assert set(signs.tolist()) == {-1.0, 1.0} and set(factor.flatten().tolist()) <= {-1.0, 1.0}


def test_half_inputs_accumulate_in_fp32():
    signs, factor, _ = online_factors(1536, "hadamard", torch.Generator().manual_seed(0))
    x = torch.randn(4, 1536, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    got = online_rotated(x, signs.to(torch.bfloat16), factor.to(torch.bfloat16))
    assert got.dtype == torch.bfloat16
    want = (x.double() @ dense(signs, factor)).to(torch.bfloat16)   # one rounding, at the end
    assert torch.equal(got, want) or rel(got, want) < 2 ** -9


@pytest.mark.parametrize("heads,method", [(False, "hadamard"), (True, "hadamard"), (True, "random")])
def test_llama_rotates_each_down_projection_online_and_keeps_its_outputs(heads, method):
    model = tiny("llama")
    before = copy.deepcopy(model)
    report = rotate(model, method=method, seed=4, heads=heads, online=True)
    downs = [f"model.layers.{i}.mlp.down_proj" for i in range(2)]   # the test's knowledge of Llama's names
    assert [o["layer"] for o in report.online] == downs and {o["width"] for o in report.online} == {48}
    assert report.online[0]["q"] == ("randomised Hadamard, fast transform 4 x 12" if method == "hadamard"
                                     else "random orthogonal, dense 48 x 48")
    ids = torch.randint(0, 61, (3, 19), generator=torch.Generator().manual_seed(7))   # not the trace's inputs
    with torch.no_grad():
        assert rel(model(input_ids=ids).logits, before(input_ids=ids).logits) <= 1e-5
    for name in downs:
        layer, old = model.get_submodule(name), before.get_submodule(name)
        h = dense(layer.normswap_online_signs.detach(), layer.normswap_online_factor.detach())
        back = layer.weight.double() @ h.T   # Qᵀ·W·H·Hᵀ: the stream's rotation Q on the output side stays
        assert rel(back.T @ back, old.weight.double().T @ old.weight.double()) < 1e-6
        assert rel(layer.weight.double().T @ layer.weight.double(), old.weight.double().T @ old.weight.double()) > 0.1
    fixes = model.config.normswap["output_fixes"]
    assert fixes == {n: {"centre": False, "bias": 0, "online": 48,
                         "online_factor": 12 if method == "hadamard" else 48} for n in downs}
    assert model.config.normswap["rotations"][0]["online"] == downs and "online, before 2 layer(s)" in \
        report.to_table()
    assert type(model).__name__ == "NormswapLlamaForCausalLM"   # its own save_pretrained ships the code
    with pytest.raises(NotRotatable, match=r"model\.layers\.0\.mlp\.down_proj is rotated online already"):
        rotate(model, online=True)


@pytest.mark.parametrize("name,layer", [("gpt2", "transformer.h.{}.mlp.c_proj"),
                                        ("opt", "model.decoder.layers.{}.fc2")])
def test_converted_models_rotate_their_mlp_output_online_in_fp64(name, layer):
    original = build(name).double()
    model = copy.deepcopy(original)
    normswap.convert(model, method="exact")
    report = rotate(model, method="hadamard", seed=1, heads=True, online=True)
    assert [o["layer"] for o in report.online] == [layer.format(i) for i in range(2)]
    parity = compare(original, model, padded_batches())   # all but the cache, stored rotated per head (R2)
    assert max(v["max_rel"] for k, v in parity.outputs.items() if not k.startswith("cache")) < 1e-5
    assert parity.outputs["logits"]["max_rel"] < 1e-5


def test_a_user_module_rotates_online_and_a_model_without_an_mlp_is_refused():
    torch.manual_seed(0)
    examples = [torch.randint(0, 61, (2, 16))]
    original = perturbed(LinearGPT())
    model = copy.deepcopy(original)
    normswap.convert(model, method="exact", example_inputs=examples)
    report = rotate(model, online=True, example_inputs=examples)   # one head over the whole width: o is not taken
    assert [(o["layer"], o["q"]) for o in report.online] == [
        (f"mlp.{i}.2", "randomised Hadamard, fast transform 1 x 72") for i in range(2)]
    y = torch.randint(0, 61, (3, 40))
    with torch.no_grad():
        assert rel(model(y), original(y)) < 1e-5
    assert model.normswap_section["output_fixes"]["mlp.0.2"] == {"centre": False, "bias": 0, "online": 72,
                                                                 "online_factor": 72}
    plain = perturbed(LinearGPT())
    plain.mlp = nn.ModuleList(nn.Linear(36, 36) for _ in plain.mlp)   # no activation: its input is the norm's
    normswap.convert(plain, method="exact", example_inputs=examples)
    with pytest.raises(NotRotatable, match="no layer to rotate online"):
        rotate(plain, online=True, example_inputs=examples)
    with pytest.raises(NormswapError, match="online must be a bool"):
        rotate(plain, online=1, example_inputs=examples)
