"""Parity and exact verification without copies of the model, and non-finite outputs never pass."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import normswap
from normswap.cli import main
from normswap.errors import NormswapError
from normswap.models.inputs import sample_inputs
from normswap.parity import compare, compare_to, reference_outputs
from normswap.surgery import exact
from helpers import CACHE
from helpers.exact_models import build, padded_batches


@pytest.fixture
def no_model_copies(monkeypatch):
    """copy.deepcopy raises on any nn.Module with submodules: a model or a block. Leaf modules may be
    copied: norm probing copies single norms (a few KB) so that their own state is never touched."""
    real = copy.deepcopy

    def guarded(obj, *a, **kw):
        if isinstance(obj, nn.Module) and any(True for _ in obj.children()):
            raise AssertionError(f"deepcopy of a {type(obj).__name__}")
        return real(obj, *a, **kw)
    monkeypatch.setattr(copy, "deepcopy", guarded)


def _gpt2_outputs(out) -> dict[str, torch.Tensor]:
    """GPT-2's outputs written out by hand: logits and every cached key and value."""
    cache = {f"{CACHE}.{i}.{k}": getattr(layer, k)
             for i, layer in enumerate(getattr(out, CACHE).layers) for k in ("keys", "values")}
    return {"logits": out.logits, **cache}


@torch.no_grad()
def _fp64_parity(reference: nn.Module, model: nn.Module, inputs: list[dict]) -> tuple[float, float, float]:
    """The deepcopy-era computation, written out per output: (max_abs, max_rel) of the output with the
    largest relative error (logits on unpadded positions, caches everywhere), and the logits' mean KL."""
    diffs: dict[str, float] = {}
    refs: dict[str, float] = {}
    kls = []
    for batch in inputs:
        outs_a, outs_b = _gpt2_outputs(reference(**batch)), _gpt2_outputs(model(**batch))
        for name in outs_a:
            a, b = outs_a[name].double(), outs_b[name].double()
            if name == "logits":
                keep = batch["attention_mask"].bool()
                a, b = a[keep], b[keep]
                la, lb = a.log_softmax(-1), b.log_softmax(-1)
                kls.append((la.exp() * (la - lb)).sum(-1))
            diffs[name] = max(diffs.get(name, 0.0), (a - b).abs().max().item())
            refs[name] = max(refs.get(name, 0.0), a.abs().max().item())
    worst = max(diffs, key=lambda n: diffs[n] / refs[n])
    return diffs[worst], diffs[worst] / refs[worst], torch.cat(kls).mean().item()


@pytest.mark.parametrize("method", ["exact", "naive"])
def test_outputs_reference_gives_the_deepcopy_numbers(method):
    model = build("gpt2")
    original = copy.deepcopy(model)           # the test's own copy, to check against
    ref = reference_outputs(model, padded_batches())
    report = normswap.convert(model, method=method)
    got = compare_to(ref, model)
    max_abs, max_rel, kl = _fp64_parity(original, model, padded_batches())
    assert (got.max_abs, got.max_rel, got.kl) == (max_abs, max_rel, kl)
    assert set(got.compared) == set(_gpt2_outputs(original(**padded_batches()[0])))   # logits and the cache
    assert got.outputs[got.worst]["max_rel"] == max_rel and not got.excluded
    assert got.finite and got.ref_nonfinite == got.nonfinite == 0
    assert (max_rel <= 1e-5) if method == "exact" else (max_rel > 0.05)
    if method == "exact":   # verification: the same comparison on sample inputs, against a copy's outputs
        expect = _fp64_parity(original, model, sample_inputs(original))
        assert report.verification["max_abs"] == expect[0] and report.verification["max_rel"] == expect[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_exact_convert_makes_no_copy_and_restores_dtypes(no_model_copies, dtype):
    model = build("gpt2").to(dtype)
    report = normswap.convert(model, method="exact")
    assert report.verification["max_rel"] <= exact.TOLERANCE[dtype]
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert not model.training


def test_cli_convert_makes_no_copy(no_model_copies, tmp_path):
    build("gpt2").save_pretrained(tmp_path / "src")
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "src"), "--to", "rmsnorm", "-o", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    assert "parity vs original (" in result.output and f"outputs: logits, {CACHE}[4])" in result.output


def _nan_weight(model: nn.Module, name: str = "transformer.h.0.mlp.c_fc.weight") -> nn.Module:
    with torch.no_grad():
        model.get_parameter(name)[0, 0] = float("nan")
    return model


def test_parity_counts_nan_on_either_side():
    model = build("gpt2")
    broken = _nan_weight(copy.deepcopy(model))
    for p, side in ((compare(model, broken), "nonfinite"), (compare(broken, model), "ref_nonfinite")):
        assert getattr(p, side) > 0 and not p.finite
        assert p.max_abs != p.max_abs and "NON-FINITE" in str(p)   # NaN, not Python max's 0.0
        assert json.loads(json.dumps(p.to_dict()))["max_abs"] is None   # valid JSON
    assert compare(model, model).max_abs == 0.0 and compare(model, model).finite


def test_exact_refuses_a_nan_source_and_leaves_it_untouched():
    model = _nan_weight(build("gpt2"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(NormswapError, match="source model gives .* non-finite"):
        normswap.convert(model, method="exact")
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.allclose(before[k], after[k], rtol=0, atol=0, equal_nan=True) for k in before)
    assert not any(isinstance(m, normswap.RMSNorm) for m in model.modules())


def test_exact_verify_refuses_a_nan_converted_model_even_unenforced():
    model = build("gpt2")
    ref = reference_outputs(model)
    _nan_weight(model)
    for enforce in (True, False):
        with pytest.raises(NormswapError, match="converted model gives .* non-finite"):
            exact.verify(ref, model, enforce=enforce)


def test_cli_never_saves_a_nan_model(tmp_path):
    _nan_weight(build("gpt2")).save_pretrained(tmp_path / "src")
    for method in ("exact", "naive"):
        out = tmp_path / method
        r = CliRunner().invoke(main, ["convert", str(tmp_path / "src"), "--to", "rmsnorm", "--method", method,
                                      "-o", str(out)])
        assert r.exit_code == 1 and not out.exists(), r.output
        assert len(r.output.strip().splitlines()) == 1 and "non-finite" in r.output


def test_cli_refuses_a_nan_source_that_stays_nan(tmp_path):
    """A NaN norm bias: norm probing reads the effective gain from the module's outputs, so the NaN reaches
    the converted norm too; the CLI must then refuse, saying that the source is at fault, count both sides
    (streamed, the converted model runs too) and write nothing."""
    model = build("gpt2")
    with torch.no_grad():
        model.transformer.ln_f.bias[0] = float("nan")
    model.save_pretrained(tmp_path / "src")
    r = CliRunner().invoke(main, ["convert", str(tmp_path / "src"), "--to", "rmsnorm", "--method", "naive",
                                  "-o", str(tmp_path / "o"), "--json"])
    assert r.exit_code == 1, r.output
    assert r.stderr.startswith("error: the source model gives ") and "non-finite (NaN/inf) logits" in r.stderr
    assert "(the converted model: " in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("method", ["exact", "auto", "naive"])
@pytest.mark.parametrize("streamed", [True, False])
def test_a_source_giving_nan_is_refused_as_the_sources_fault(tmp_path, method, streamed):
    """Issue 46 #5: a source whose outputs are NaN/inf was reported as a failed verification (streamed exact),
    or saved (auto and naive: position rows of 1e38 overflow the LayerNorms, not the RMSNorms)."""
    model = build("gpt2")
    with torch.no_grad():
        model.transformer.wpe.weight[3] = 1e38
    model.save_pretrained(tmp_path / "src")
    where = ["--onnx", str(tmp_path / "m.onnx")] if not streamed else []   # converts in memory
    r = CliRunner().invoke(main, ["convert", str(tmp_path / "src"), "--to", "rmsnorm", "--method", method,
                                  "-o", str(tmp_path / "o"), *where])
    assert r.exit_code == 1 and len(r.output.strip().splitlines()) == 1, r.output
    assert r.output.startswith("error: the source model gives ") and "it is broken" in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def _no_nan(name):
    raise AssertionError(f"invalid JSON constant {name}")


def test_cli_eval_json_of_a_nan_model_is_valid_json_and_fails(tmp_path):
    from helpers.heal_models import gpt2, text, tokenizer
    tok = tokenizer()
    model = gpt2(len(tok))
    normswap.save_pretrained(model, tmp_path / "ok", tokenizer=tok)
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight[0, 0] = float("nan")
    normswap.save_pretrained(model, tmp_path / "nan", tokenizer=tok)
    (tmp_path / "d.txt").write_text(text(200, seed=3))
    args = ["--data", str(tmp_path / "d.txt"), "--seq-len", "32", "--json"]
    r = CliRunner().invoke(main, ["eval", str(tmp_path / "nan"), *args, "--reference", str(tmp_path / "ok")])
    assert r.exit_code == 1
    got = json.loads(r.stdout, parse_constant=_no_nan)   # strict JSON: NaN/Infinity are not JSON
    assert got["perplexity"] is None and got["kl"] is None and "non-finite" in got["error"]
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("error: ")
    ok = CliRunner().invoke(main, ["eval", str(tmp_path / "ok"), *args])
    assert ok.exit_code == 0 and "error" not in json.loads(ok.stdout)
    assert json.loads(ok.stdout)["perplexity"] > 1


def test_sample_inputs_without_a_position_limit(tmp_path):
    """XLNet's max_position_embeddings is -1 (no limit): sample inputs are built, and its folder converts lazily (it
    was a RuntimeError about a negative dimension)."""
    import transformers as tf
    from helpers.exact_models import perturb
    from normswap.pipeline import lazy_convert
    from normswap.models.inputs import sample_inputs
    torch.manual_seed(0)
    model = perturb(tf.XLNetLMHeadModel(tf.XLNetConfig(vocab_size=101, d_model=32, n_layer=2, n_head=4,
                                                       d_inner=64))).eval()
    assert model.config.max_position_embeddings == -1
    assert [x["input_ids"].shape[-1] for x in sample_inputs(model)] == [16, 33]
    model.save_pretrained(tmp_path / "src")
    report, parity = lazy_convert.convert_folder(tmp_path / "src", tmp_path / "out")
    assert report.converted and parity.max_rel > 0   # naive (XLNet is post-LN), reported


def test_a_model_failing_on_its_sample_inputs_is_refused_in_one_line():
    """Not `error: IndexError: ...` on the command line: which model, which error, and why nothing can be
    checked, in one line (one-row retries included)."""
    model = build("gpt2")
    bad = [{"input_ids": torch.full((2, 4), 10_000)}]   # beyond the vocabulary
    with pytest.raises(NormswapError, match=r"GPT2LMHeadModel fails on the sample inputs normswap built for it "
                                            r"\(IndexError: .*\), so no conversion of it can be checked") as e:
        reference_outputs(model, bad)
    assert "\n" not in str(e.value)
