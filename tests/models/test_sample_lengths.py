"""The text samples' longest row: as long as the config's position limit allows (fewer where the position
table starts after a padding row), capped at `text.LONGEST`; none where no limit is stated or the model
rejects it."""
from __future__ import annotations

import torch
import transformers as tf
from torch import nn

from normswap.models.inputs import sample_inputs
from normswap.models.inputs.text import LONGEST

TINY = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, vocab_size=50)


def lengths(model: nn.Module) -> list[int]:
    return [x["input_ids"].shape[-1] for x in sample_inputs(model)]


def test_gpt2_rows_reach_its_positions_up_to_the_cap():
    small = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=50, n_positions=48)).eval()
    assert lengths(small) == [16, 33, 48]
    large = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=50, n_positions=4096))
    assert max(lengths(large.eval())) == LONGEST == 512


def test_roberta_positions_start_after_the_padding_row():
    """RoBERTa numbers positions from pad_token_id + 1: 40 positions hold 38 tokens; the model runs on them."""
    model = tf.RobertaModel(tf.RobertaConfig(**TINY, max_position_embeddings=40, pad_token_id=1)).eval()
    batches = sample_inputs(model)
    assert batches[-1]["input_ids"].shape == (1, 38)
    with torch.no_grad():
        assert model(**batches[-1]).last_hidden_state.shape == (1, 38, 16)


def test_no_stated_limit_no_long_row():
    """T5's relative positions state no limit: no row past the usual 33 tokens."""
    model = tf.T5Model(tf.T5Config(d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, vocab_size=50)).eval()
    assert max(lengths(model)) == 33


class Short(nn.Module):
    """Claims 64 positions but rejects more than 40 tokens: its long row is left out, not a failed trace."""

    main_input_name = "input_ids"

    def __init__(self):
        super().__init__()
        self.config = tf.PretrainedConfig(vocab_size=50, max_position_embeddings=64)
        self.embed = nn.Embedding(50, 8)

    def forward(self, input_ids):
        if input_ids.shape[1] > 40:
            raise ValueError("too long")
        return self.embed(input_ids)


def test_a_long_row_the_model_rejects_is_left_out():
    assert lengths(Short()) == [16, 33]
