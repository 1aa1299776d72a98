"""evaluate(): sliding-window perplexity, KL / top-1 against a reference, encoder embedding cosine."""
from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from helpers.heal_models import bert, gpt2, perturb_norms, text, tokenizer
from click.testing import CliRunner

import normswap
from normswap.cli import main
from normswap.errors import NormswapError
from normswap.evaluation import evaluate, windows
from normswap.textdata import joined_ids


@pytest.fixture(scope="module")
def tok():
    return tokenizer()


@pytest.fixture(scope="module")
def lm(tok):
    return gpt2(len(tok))


def _by_hand(model, ids, context_start: dict[int, int], reference=None):
    """Mean NLL (and KL to reference), each token predicted from ids[start:t] by its own forward pass."""
    nll = kl = 0.0
    with torch.no_grad():
        for t, start in context_start.items():
            lp = model(input_ids=ids[None, start:t]).logits[0, -1].double().log_softmax(-1)
            nll -= lp[ids[t]].item()
            if reference is not None:
                rp = reference(input_ids=ids[None, start:t]).logits[0, -1].double().log_softmax(-1)
                kl += (rp.exp() * (rp - lp)).sum().item()
    return nll / len(context_start), kl / len(context_start)


def test_sliding_window_perplexity_matches_hand_computation(lm, tok):
    sample = "She was not at the house."
    ids = joined_ids(tok, [sample])
    assert len(ids) == 9  # 8 tokens + EOS with this tokenizer
    # seq_len 4, stride 2 over 9 tokens: windows [0,4) [2,6) [4,8) [6,9); each scores only new tokens,
    # so token t is predicted from ids[start:t] with these starts:
    starts = {1: 0, 2: 0, 3: 0, 4: 2, 5: 2, 6: 4, 7: 4, 8: 6}
    assert [(b, e) for b, e, _ in windows(9, 4, 2)] == [(0, 4), (2, 6), (4, 8), (6, 9)]
    reference = copy.deepcopy(lm)
    perturb_norms(reference, seed=7)
    nll, kl = _by_hand(lm, ids, starts, reference)
    rep = evaluate(lm, tok, [sample], reference=reference, seq_len=4, stride=2)
    assert rep.tokens == 8
    assert rep.nll == pytest.approx(nll, rel=1e-5)
    assert rep.perplexity == pytest.approx(math.exp(nll), rel=1e-5)
    assert rep.kl == pytest.approx(kl, rel=1e-4)


def test_single_window_is_plain_causal_perplexity(lm, tok):
    ids = joined_ids(tok, ["Emma said she would walk."])
    n = len(ids)
    nll, _ = _by_hand(lm, ids, {t: 0 for t in range(1, n)})
    rep = evaluate(lm, tok, ["Emma said she would walk."], seq_len=n, stride=n - 1)
    assert rep.tokens == n - 1
    assert rep.perplexity == pytest.approx(math.exp(nll), rel=1e-5)


@pytest.mark.parametrize("n,seq,stride", [(50, 8, 3), (50, 8, 7), (17, 64, 32), (40, 10, 1)])
def test_every_token_scored_once_with_enough_context(n, seq, stride):
    scored = []
    for b, e, first in windows(n, seq, stride):
        assert e - b <= seq
        scored += range(first, e)
        if b > 0:
            assert first - b >= seq - stride  # context of the first token this window scores
    assert scored == list(range(1, n))


def test_model_against_itself_kl_zero_top1_one(lm, tok):
    rep = evaluate(lm, tok, [text(400)], reference=lm, seq_len=32, stride=16)
    assert rep.kl == pytest.approx(0.0, abs=1e-9)
    assert rep.top1_agreement == 1.0


def test_naive_swap_moves_kl_and_top1(lm, tok):
    student = copy.deepcopy(lm)
    normswap.convert(student, method="naive")
    rep = evaluate(student, tok, [text(400)], reference=lm, seq_len=32, stride=16)
    assert rep.kl > 1e-3 and rep.top1_agreement < 1.0


def test_bad_stride_is_an_error(lm, tok):
    with pytest.raises(NormswapError, match="stride"):
        evaluate(lm, tok, [text(100)], seq_len=8, stride=8)


def test_encoder_cosine():
    btok = tokenizer(bert=True)
    ref = bert(len(btok))
    texts = [text(600)]
    same = evaluate(ref, btok, texts, reference=ref)
    assert same.cosine == pytest.approx(1.0, abs=1e-9) and same.sentences > 20
    student = copy.deepcopy(ref)
    normswap.convert(student, method="naive")
    moved = evaluate(student, btok, texts, reference=ref)
    assert moved.cosine < 0.999 and moved.cosine_min <= moved.cosine
    with pytest.raises(NormswapError, match="reference"):
        evaluate(ref, btok, texts)


def test_cli_eval_json_matches_api(lm, tok, tmp_path):
    normswap.save_pretrained(lm, tmp_path / "orig", tokenizer=tok)
    student = copy.deepcopy(lm)
    normswap.convert(student, method="naive")
    normswap.save_pretrained(student, tmp_path / "conv", tokenizer=tok)
    data = tmp_path / "d.txt"
    data.write_text(text(300, seed=3))
    r = CliRunner().invoke(main, ["eval", str(tmp_path / "conv"), "--data", str(data), "--reference",
                                  str(tmp_path / "orig"), "--seq-len", "32", "--json"])
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    want = evaluate(student, tok, [data.read_text()], reference=lm, seq_len=32)
    assert got["stride"] == 16
    for key in ("perplexity", "kl", "top1_agreement"):
        assert got[key] == pytest.approx(getattr(want, key), rel=1e-5)


def test_cli_eval_reference_with_other_vocabulary_is_one_line_error(lm, tok, tmp_path):
    other = tokenizer(vocab=120)
    normswap.save_pretrained(lm, tmp_path / "a", tokenizer=tok)
    normswap.save_pretrained(gpt2(len(other)), tmp_path / "b", tokenizer=other)
    r = CliRunner().invoke(main, ["eval", str(tmp_path / "a"), "--reference", str(tmp_path / "b")])
    assert r.exit_code == 1
    assert r.stderr.startswith("error: ") and "tokenizer does not match" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


class _Shifted(torch.nn.Module):
    """`model` with every logit raised by `c`: the same distributions, rounded differently."""

    def __init__(self, model, c):
        super().__init__()
        self.model, self.c, self.config = model, c, model.config

    def forward(self, **kw):
        out = self.model(**kw)
        out.logits = out.logits + self.c
        return out


def test_kl_of_equal_distributions_is_never_negative(lm, tok):
    """Issue 33 #15: `eval` printed KL -1.75e-09; the float32 rounding of two equal distributions averaged
    below 0 (here -6e-9 before)."""
    rep = evaluate(lm, tok, [text(400)], reference=_Shifted(lm, 1000.0), seq_len=32, stride=16)
    assert 0.0 <= rep.kl < 1e-8 and rep.top1_agreement == 1.0
