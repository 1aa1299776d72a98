"""A norm's bias folds into its readers unless that gives bias-less readers biases more than WIDE_FOLD times the
norm's width (a vocabulary-wide LM head): then it stays after the norm, the outputs unchanged either way."""
from __future__ import annotations

import copy

import pytest
import torch

import normswap
from normswap.parity import compare
from normswap.surgery.plan import WIDE_FOLD
from helpers.exact_models import build, padded_batches
from helpers.user_models import gpt

D = 32   # helpers.user_models.GPT's width


@pytest.mark.parametrize("vocab, fate", [(WIDE_FOLD * D, "fold"), (WIDE_FOLD * D + 1, "after")])
def test_a_bias_less_head_is_given_the_fold_only_while_narrow(vocab, fate):
    original = gpt(vocab=vocab)
    model = copy.deepcopy(original)
    examples = (torch.randint(0, vocab, (2, 9)), torch.randn(2, 8))   # (idx, prefix): every layer runs
    report = normswap.convert(model, method="exact", example_inputs=examples)
    kept = getattr(model.ln_f, "normswap_bias", None)
    assert ("head" in report.added_biases) == (model.head.bias is not None) == (fate == "fold")
    assert (kept is not None) == (fate == "after")
    if kept is not None:   # the original ln_f bias itself, kept as it was
        assert torch.equal(kept, original.ln_f.bias.detach())
    x = torch.randint(0, vocab, (3, 11))
    with torch.no_grad():
        ref, out = original(x), model(x)
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 1e-5


def test_a_tied_vocabulary_wide_head_stays_bias_less_and_tied(tmp_path):
    original = build("gpt2-wide-vocab")
    model = copy.deepcopy(original)
    report = normswap.convert(model, method="exact")
    assert model.lm_head.bias is None and "lm_head" not in report.added_biases
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.transformer.ln_f.normswap_bias is not None
    assert sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in original.parameters())
    assert compare(original, model, padded_batches()).max_rel < 1e-5
    normswap.save_pretrained(model, tmp_path / "m")
    assert compare(original, normswap.from_pretrained(tmp_path / "m"), padded_batches()).max_rel < 1e-5
