"""`evaluate_checkpoint`: a saved model's perplexity and agreement with its reference, from Python."""
from __future__ import annotations

import copy

import pytest
from helpers.heal_models import gpt2, perturb_norms, text, tokenizer

import normswap
from normswap.errors import NormswapError
from normswap.evaluation import evaluate
from normswap.pipeline import EvaluateOptions, evaluate_checkpoint


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """d/a: a GPT-2 with its tokenizer; d/b: the same with other norms; d/c: another vocabulary; d/text.txt."""
    d = tmp_path_factory.mktemp("eval")
    tok = tokenizer()
    model = gpt2(len(tok))
    other = copy.deepcopy(model)
    perturb_norms(other, seed=5)
    normswap.save(model, d / "a", tokenizer=tok)
    normswap.save(other, d / "b", tokenizer=tok)
    small = tokenizer(vocab=120)
    normswap.save(gpt2(len(small)), d / "c", tokenizer=small)
    (d / "text.txt").write_text(text(400))
    return d, model, other, tok


def test_values_match_evaluate_on_the_loaded_models(saved):
    d, model, other, tok = saved
    got = evaluate_checkpoint(str(d / "a"), EvaluateOptions(data=(str(d / "text.txt"),), reference=str(d / "b"),
                                                            seq_len=32, device="cpu"))
    want = evaluate(model, tok, [(d / "text.txt").read_text()], reference=other, seq_len=32)
    assert (got.kind, got.seq_len, got.stride, got.tokens) == ("causal-lm", 32, 16, want.tokens)
    for key in ("perplexity", "kl", "top1_agreement"):
        assert getattr(got, key) == pytest.approx(getattr(want, key), rel=1e-5)
    assert got.kl > 0


def test_without_reference_or_data_scores_the_bundled_text(saved):
    d, model, _, tok = saved
    got = evaluate_checkpoint(str(d / "a"), EvaluateOptions(seq_len=32, batch_size=3))
    assert got.kl is None and got.perplexity == pytest.approx(evaluate(model, tok, seq_len=32).perplexity, rel=1e-5)


def test_a_reference_with_another_vocabulary_is_refused(saved):
    d, *_ = saved
    with pytest.raises(NormswapError, match=r"the reference's tokenizer does not match the model's \(120 vs 160"):
        evaluate_checkpoint(str(d / "a"), EvaluateOptions(reference=str(d / "c")))
