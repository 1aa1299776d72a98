"""Exact (function-preserving) conversion: every supported family, refusals, fallback, CLI, demo model."""
from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import transformers as tf
from click.testing import CliRunner
from torch import nn

import normswap
from normswap.cli import main
from normswap.errors import NormswapError
from normswap.norms import RMSNorm
from normswap.parity import compare
from normswap.surgery import exact as exact_mod, find_norms
from normswap.surgery.labels import Cause
from helpers.exact_models import FAMILIES, build, padded_batches, perturb


def _tied(model: nn.Module) -> bool:
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return out is not None and out.weight is model.get_input_embeddings().weight


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # shared (tied) tensors count once


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_exact_family(name, tmp_path):
    model = build(name)
    reference, naive = copy.deepcopy(model), copy.deepcopy(model)
    tied, params = _tied(model), _count(model)
    ln_biases = sum(s.bias.numel() for s in find_norms(model)[0] if s.bias is not None)

    normswap.convert(naive, method="naive")
    assert compare(reference, naive, padded_batches()).max_rel > 0.1   # the perturbation matters

    report = normswap.convert(model, method="exact")
    assert not [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    assert {r.method for r in report.converted} == {"exact"} and "folded" in {r.bias for r in report.converted}
    assert report.verification["enforced"] and report.verification["max_rel"] <= 1e-4
    assert compare(reference, model, padded_batches()).max_rel <= 1e-5

    # Tying and parameter count: LN biases leave, created biases (and kept output biases) arrive.
    assert _tied(model) == tied
    added = sum(model.get_submodule(n).bias.numel() for n in report.added_biases)
    kept = sum(m.normswap_bias.numel() for m in model.modules() if hasattr(m, "normswap_bias"))
    assert _count(model) == params - ln_biases + added + kept

    normswap.save_pretrained(model, tmp_path / "m")
    loaded = normswap.from_pretrained(tmp_path / "m")
    assert _tied(loaded) == tied
    assert compare(model, loaded, padded_batches()).max_abs == 0.0
    assert compare(reference, loaded, padded_batches()).max_rel <= 1e-5


def test_auto_is_exact_for_supported_models():
    model = build("gpt2")
    report = normswap.convert(model, method="auto")
    assert report.method == "exact" and not report.warnings and report.verification["max_rel"] <= 1e-4


def _bert():
    config = tf.BertConfig(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    return perturb(tf.BertModel(config)).eval()


def test_exact_in_two_filtered_passes():
    """Norms left as LayerNorm by filter_fn stay correct (LayerNorm ignores the centring); a second pass
    converts them."""
    model = build("bloom")
    reference = copy.deepcopy(model)
    first = normswap.convert(model, method="exact", filter_fn=lambda m, n: n.endswith("input_layernorm"))
    assert first.num_converted == 2 and compare(reference, model, padded_batches()).max_rel <= 1e-5
    second = normswap.convert(model, method="exact")
    assert second.num_converted == 4 and compare(reference, model, padded_batches()).max_rel <= 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_exact_in_two_filtered_passes_in_half_precision(dtype):
    """In bf16 and fp16 the rows centred weights write are centred only to ~eps/3 of their RMS: the second
    pass's RMSNorms still read them as centred (at a 1e-4 threshold they were taken for layers reading an
    uncentred stream, and the second pass was refused)."""
    model = build("bloom").to(dtype)
    reference = copy.deepcopy(model)
    first = normswap.convert(model, method="exact", filter_fn=lambda m, n: n.endswith("input_layernorm"))
    second = normswap.convert(model, method="exact")
    assert (first.num_converted, second.num_converted) == (2, 4)
    assert compare(reference, model, padded_batches()).max_rel <= 3e-2


def test_post_ln_refused_with_alternatives():
    model = _bert()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(NormswapError) as e:
        normswap.convert(model, method="exact")
    msg = str(e.value)
    assert "\n" not in msg and "embeddings.LayerNorm is post-LN" in msg and "method='naive'" in msg
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # untouched


def test_auto_falls_back_to_naive_with_warning():
    report = normswap.convert(_bert(), method="auto")
    assert report.method == "naive" and {r.method for r in report.converted} == {"naive"}
    assert len(report.warnings) == 1 and "post-LN" in report.warnings[0] and "naive" in report.warnings[0]
    assert "warning: no exact conversion" in report.to_table()


@pytest.mark.parametrize("family, kw, norm", [
    ("opt", dict(do_layer_norm_before=False), "self_attn_layer_norm"),
    ("bloom", dict(apply_residual_connection_post_layernorm=True), "input_layernorm"),
])
def test_post_ln_variants_refused_from_the_graph(family, kw, norm):
    """Refused, or (BLOOM: its embedding norm, before the post-LN blocks, converts exactly) the post-LN norms kept
    as LayerNorms, each named with its cause."""
    cfg_cls, base, model_cls = FAMILIES[family]
    model = model_cls(cfg_cls(**{**base, "vocab_size": 101, **kw}))
    if family == "opt":
        with pytest.raises(exact_mod.NotExact) as e:
            normswap.convert(model, method="exact")
        assert e.value.cause is Cause.POST_LN and e.value.refusal.modules[0].endswith(norm)
        return
    report = normswap.convert(model, method="exact")
    assert [r.name for r in report.converted] == ["transformer.word_embeddings_layernorm"]
    assert {s.refusal.cause for s in report.skipped} == {Cause.POST_LN}
    assert any(s.name.endswith(norm) for s in report.skipped)


def test_verification_catches_a_wrong_plan(forgetful, monkeypatch):
    """A plan that forgets a source must fail loudly, not return a broken model: before any edit (the
    rehearsal), and after the edits too when the rehearsal is skipped."""
    with pytest.raises(exact_mod.NotExact) as before:
        normswap.convert(build("gpt2"), method="exact")
    monkeypatch.setattr(exact_mod, "rehearse", lambda *a, **k: None)
    with pytest.raises(exact_mod.VerificationFailed) as after:
        normswap.convert(build("gpt2"), method="exact")
    assert before.value.cause is after.value.cause is Cause.UNVERIFIED
    assert "before any edit" in str(before.value) and "max relative logits error" in str(after.value)   # named


@pytest.mark.parametrize("family, dtype, tol", [("falcon-parallel", torch.float16, 2e-3),
                                                ("falcon-parallel", torch.bfloat16, 2e-2),
                                                ("mbart", torch.float16, 2e-3)])   # fp16 overflow clamps
def test_half_precision_models_verify_in_fp32(family, dtype, tol):
    model = build(family).to(dtype)
    report = normswap.convert(model, method="exact")
    assert next(model.parameters()).dtype == dtype   # stored in the model's dtype
    assert report.verification["dtype"] == str(dtype)[6:] and report.verification["max_rel"] <= tol


def test_prmsnorm_folds_but_does_not_claim_exactness():
    model = build("gpt2")
    report = normswap.convert(model, to="prmsnorm", method="exact")
    assert not report.verification["enforced"] and any("approximate" in w for w in report.warnings)
    # issue 33 #15: its rows were labelled `exact`
    assert {r.method for r in report.converted} == {"approximate"} and "  exact  " not in report.to_table()


def test_cli_default_is_auto_and_exact(tmp_path):
    model = build("gpt2")
    model.save_pretrained(tmp_path / "src")
    args = ["convert", str(tmp_path / "src"), "--to", "rmsnorm", "-o", str(tmp_path / "out")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert normswap.models.source.read_config(tmp_path / "out")["normswap"]["conversions"][-1]["method"] == "exact"
    loaded = normswap.from_pretrained(tmp_path / "out")
    assert compare(model, loaded, padded_batches()).max_rel <= 1e-5
    shown = CliRunner().invoke(main, ["inspect", str(tmp_path / "src")]).output
    assert shown.count("(exact: bias folded)") == 5 and "no exact" not in shown   # ln_1, ln_2 x 2, ln_f


def test_cli_exact_on_post_ln_exits_1_and_writes_nothing(tmp_path):
    _bert().save_pretrained(tmp_path / "bert")
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "bert"), "--to", "rmsnorm", "--method", "exact",
                                       "-o", str(out)])
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot convert exactly: embeddings.LayerNorm is post-LN")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bert"]
    shown = CliRunner().invoke(main, ["inspect", str(tmp_path / "bert")]).output
    assert "no exact conversion: embeddings.LayerNorm is post-LN" in shown and "(naive drops the bias)" in shown


# --- the bundled demo model: held-out perplexity is unchanged -------------------------------------------

def _perplexity(model, ids: torch.Tensor, window: int = 128) -> float:
    """Perplexity over non-overlapping windows of `window` tokens."""
    nll, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, window):
            chunk = ids[start:start + window + 1]
            if len(chunk) < 2:
                break
            logits = model(input_ids=chunk[None, :-1]).logits[0].double()
            nll += torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum").item()
            count += len(chunk) - 1
    return math.exp(nll / count)


def test_demo_model_perplexity_unchanged():
    from normswap.models.demo import DEMO_NAME, heldout_text
    model, tokenizer = normswap.load_model(DEMO_NAME)
    ids = torch.tensor(tokenizer(heldout_text())["input_ids"][:4096])
    before = _perplexity(model, ids)
    report = normswap.convert(model, method="exact")
    after = _perplexity(model, ids)
    assert report.verification["max_rel"] <= 1e-4
    assert f"{before:.4g}" == f"{after:.4g}"
    assert all(isinstance(model.get_submodule(r.name), RMSNorm) for r in report.converted)


def test_what_the_report_says_is_not_preserved_the_folder_records_and_every_load_names(tmp_path):
    """Issue 33 #11: after an exact GPT-2 conversion hidden_states[-1] differs by ln_f's bias; the report said
    so, but the folder's `not_preserved` did not, so a plain transformers load gave no warning."""
    import warnings as w

    from transformers import AutoModelForCausalLM

    from helpers.tiny import tiny_model
    model = tiny_model("gpt2")
    reference = copy.deepcopy(model)
    report = normswap.convert(model, method="exact")
    assert report.method == "exact" and "hidden_states" in report.not_preserved
    normswap.save_pretrained(model, tmp_path / "m")
    section = json.loads((tmp_path / "m" / "config.json").read_text())["normswap"]
    assert section["not_preserved"] == report.not_preserved
    with w.catch_warnings(record=True) as seen:
        w.simplefilter("always")
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "m", trust_remote_code=True).eval()
    assert any("except hidden_states (output_hidden_states=True" in str(s.message) for s in seen)
    x = torch.randint(0, model.config.vocab_size, (2, 7))
    with torch.no_grad():
        ref, got = reference(x, output_hidden_states=True), plain(x, output_hidden_states=True)
    assert torch.allclose(ref.logits, got.logits, atol=1e-4)   # the model's output is the original's,
    assert (ref.hidden_states[-1] - got.hidden_states[-1]).abs().max() > 0.1   # its hidden states are not
