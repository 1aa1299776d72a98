"""One vocabulary check for every comparison token by token: heal's teacher, eval's reference."""
from __future__ import annotations

import pytest
from helpers.heal_models import bert, gpt2, tokenizer

from normswap.errors import NormswapError
from normswap.evaluation import check_vocabulary


def test_same_vocabulary_passes():
    tok = tokenizer()
    check_vocabulary(gpt2(len(tok)), gpt2(len(tok), seed=1), "the teacher", (tok, tokenizer()))
    check_vocabulary(bert(50), bert(50, seed=1), "the teacher")   # no output head: config.vocab_size
    check_vocabulary(gpt2(len(tok)), None, "the reference", (tok, None))


def test_other_tokenizer_is_refused_first():
    tok, other = tokenizer(), tokenizer(vocab=120)
    with pytest.raises(NormswapError, match=r"^the reference's tokenizer does not match the model's \(120 vs 160 "
                                            r"tokens, \d+ mapped differently\): they must share one vocabulary$"):
        check_vocabulary(gpt2(len(tok)), gpt2(len(other)), "the reference", (tok, other))


@pytest.mark.parametrize("make", [gpt2, bert])
def test_other_number_of_tokens_is_refused(make):
    with pytest.raises(NormswapError, match=r"^the teacher's vocabulary differs from the model's \(57 vs 50 tokens\)$"):
        check_vocabulary(make(50), make(57), "the teacher")
