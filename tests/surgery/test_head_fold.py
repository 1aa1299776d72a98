"""A final norm's bias read only by linear readers folds into them at any width (issue 50): a bias-less LM head is
given W·b, tied or not, and no module keeps a forward hook; where the norm's output is also returned (a headless
model), its bias stays after it, in the norm's own forward."""
from __future__ import annotations

import copy

import pytest
import torch

import normswap
from normswap.parity import compare
from helpers.exact_models import build, padded_batches
from helpers.user_models import gpt

D = 32   # helpers.user_models.GPT's width


def no_hooks(model: torch.nn.Module) -> bool:
    return not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def head_bias_error(head: torch.nn.Module, weight: torch.Tensor, bias: torch.Tensor) -> float:
    """The head's bias against W·b in float64 (`weight`, `bias`: the original's head weight and norm bias)."""
    want = weight.detach().double() @ bias.detach().double()
    return ((head.bias.detach().double() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("vocab", [4 * D, 50 * D])
def test_a_bias_less_head_is_given_the_norms_bias_at_any_width(vocab):
    original = gpt(vocab=vocab)
    model = copy.deepcopy(original)
    examples = (torch.randint(0, vocab, (2, 9)), torch.randn(2, 8))   # (idx, prefix): every layer runs
    report = normswap.convert(model, method="exact", example_inputs=examples)
    assert "head" in report.added_biases and not hasattr(model.ln_f, "normswap_centre") and no_hooks(model)
    assert head_bias_error(model.head, original.head.weight, original.ln_f.bias) < 1e-6
    x = torch.randint(0, vocab, (3, 11))
    with torch.no_grad():
        ref, out = original(x), model(x)
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-5


def test_a_tied_vocabulary_wide_head_is_given_the_bias_and_stays_tied(tmp_path):
    original = build("gpt2-wide-vocab")
    model = copy.deepcopy(original)
    report = normswap.convert(model, method="exact")
    assert report.added_biases == ["lm_head"] and model.lm_head.weight is model.transformer.wte.weight
    assert not hasattr(model.transformer.ln_f, "normswap_centre") and no_hooks(model)
    assert model.transformer.wte.normswap_centre   # centred at lookup, in its own forward: the tie keeps E
    assert head_bias_error(model.lm_head, original.lm_head.weight, original.transformer.ln_f.bias) < 1e-6
    assert compare(original, model, padded_batches()).max_rel < 1e-5
    normswap.save_pretrained(model, tmp_path / "m")
    loaded = normswap.from_pretrained(tmp_path / "m")
    assert loaded.lm_head.weight is loaded.transformer.wte.weight and no_hooks(loaded)
    assert compare(original, loaded, padded_batches()).max_rel < 1e-5


def test_a_returned_final_norm_keeps_its_bias_in_its_own_forward():
    original = build("gpt2-headless")
    model = copy.deepcopy(original)
    report = normswap.convert(model, method="exact")
    ln_f = model.ln_f
    assert report.added_biases == [] and torch.equal(ln_f.normswap_bias, original.ln_f.bias.detach())
    assert no_hooks(model) and type(ln_f).normswap_fixes == (True, False)
    assert compare(original, model, padded_batches()).max_rel < 1e-5


@pytest.mark.slow
def test_folded_and_fixed_gpt2s_load_in_plain_transformers_as_the_original(tmp_path):
    """Saved, the three load in plain transformers (NORMSWAP_PLAIN_PYTHON: the other major version) as the
    originals: the head's new bias, the centring at lookup and the kept bias, from the shipped file."""
    from helpers.plain import check_loads, convert_all
    cases = {name: (lambda n=name: build(n)) for name in ("gpt2", "gpt2-wide-vocab", "gpt2-headless")}
    assert check_loads(tmp_path, convert_all(tmp_path, cases)) == []
