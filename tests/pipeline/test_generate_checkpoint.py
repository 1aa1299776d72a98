"""`normswap generate` / `generate_checkpoint` (issue 33 #16): a converted model's greedy continuation is
transformers' own `generate` on the same folder; bad inputs are one-line errors."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import normswap
from normswap.errors import NormswapError
from normswap.pipeline.generate import generate_checkpoint
from normswap.pipeline.options import GenerateOptions

from helpers.cli import one_error_line, run
from helpers.heal_models import bert, gpt2, tokenizer

PROMPT = "Emma said that her sister"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A naively converted tiny GPT-2 folder with its tokenizer (eos 0 is not among the first 12 tokens)."""
    tok = tokenizer()
    model = gpt2(len(tok))
    normswap.convert(model, method="naive")
    out = tmp_path_factory.mktemp("gen") / "conv"
    normswap.save(model, out, tokenizer=tok)
    return out, tok


def test_greedy_ids_are_transformers_own_generate(converted):
    out, tok = converted
    result = run("generate", out, PROMPT, "--max-new-tokens", 12, "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)
    plain = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    want = plain.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                          pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert got["prompt_ids"] == ids[0].tolist() and got["new_ids"] == want and len(want) > 0
    assert got["text"] == tok.decode(want, skip_special_tokens=True)
    text = run("generate", out, PROMPT, "--max-new-tokens", 12, "--device", "cpu")
    assert text.exit_code == 0 and text.output == PROMPT + got["text"] + "\n"


def test_sampling_repeats_with_its_seed(converted):
    out, _ = converted
    a, b = (generate_checkpoint(str(out), PROMPT, GenerateOptions(max_new_tokens=8, sample=True, seed=3,
                                                                  device="cpu")) for _ in range(2))
    assert a.new_ids == b.new_ids


def test_an_encoder_and_an_empty_prompt_are_one_line_errors(tmp_path, converted):
    tok = tokenizer(bert=True)
    normswap.save(copy.deepcopy(bert(len(tok))), tmp_path / "bert", tokenizer=tok)
    result = run("generate", tmp_path / "bert", "hello", "--allow-missing-weights")
    assert result.exit_code == 1 and result.output.strip().splitlines()[-1] == \
        f"error: generate needs a causal LM; {tmp_path / 'bert'} is a BertModel"   # after the weights' warning
    assert one_error_line(run("generate", converted[0], "", "--device", "cpu")) == \
        "error: the prompt is empty: give some text to continue"
    with pytest.raises(NormswapError, match="max_new_tokens"):
        generate_checkpoint(str(converted[0]), PROMPT, GenerateOptions(max_new_tokens=0))


def test_the_context_window_bounds_the_prompt_and_the_continuation(converted):
    """Issue 46 #5: past the window (64 positions here) generate failed with IndexError."""
    out, tok = converted
    n = len(tok(PROMPT)["input_ids"])
    with pytest.warns(UserWarning, match=f"reads at most 64 tokens .*: generating {64 - n} new tokens after the "
                                         f"prompt's {n}, not 100"):
        result = generate_checkpoint(str(out), PROMPT, GenerateOptions(max_new_tokens=100, device="cpu"))
    assert 0 < len(result.new_ids) <= 64 - n
    long = " ".join([PROMPT] * 20)
    line = one_error_line(run("generate", out, long, "--device", "cpu"))
    assert line == f"error: the prompt is {len(tok(long)['input_ids'])} tokens and {out} reads at most 64 (its " \
                   "context window): shorten the prompt"


def test_a_prompt_that_is_not_utf8_is_a_one_line_error(converted):
    """Issue 46 #5: bytes that are not UTF-8 on the command line (kept by Python as lone surrogates) gave
    TypeError from the tokenizer."""
    line = one_error_line(run("generate", converted[0], "caf\udce9 au lait", "--device", "cpu"))
    assert line == "error: the prompt is not valid UTF-8 text (position 3): give it as UTF-8"
