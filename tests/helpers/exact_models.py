"""Tiny perturbed models of every family the exact conversion supports."""
from __future__ import annotations

import torch
import transformers as tf
from torch import nn

V, D, L = 101, 32, 2
COMMON = dict(vocab_size=V, tie_word_embeddings=None)

# name -> (config class, kwargs, model class); tie_word_embeddings=None keeps the family's default.
FAMILIES = {
    "gpt2": (tf.GPT2Config, dict(n_layer=L, n_embd=D, n_head=4, n_positions=64), tf.GPT2LMHeadModel),
    "gpt2-headless": (tf.GPT2Config, dict(n_layer=L, n_embd=D, n_head=4, n_positions=64), tf.GPT2Model),
    # a vocabulary over 4x the width, as real LMs have: ln_f's bias folds into the tied head all the same
    "gpt2-wide-vocab": (tf.GPT2Config, dict(n_layer=L, n_embd=D, n_head=4, n_positions=64, vocab_size=5 * D),
                        tf.GPT2LMHeadModel),
    "opt": (tf.OPTConfig, dict(num_hidden_layers=L, hidden_size=D, ffn_dim=64, num_attention_heads=4,
                               max_position_embeddings=64, word_embed_proj_dim=D), tf.OPTForCausalLM),
    "opt-project": (tf.OPTConfig, dict(num_hidden_layers=L, hidden_size=D, ffn_dim=64, num_attention_heads=4,
                                       max_position_embeddings=64, word_embed_proj_dim=16), tf.OPTForCausalLM),
    "gpt_neox-parallel": (tf.GPTNeoXConfig, dict(num_hidden_layers=L, hidden_size=D, num_attention_heads=4,
                                                 intermediate_size=64, max_position_embeddings=64,
                                                 use_parallel_residual=True), tf.GPTNeoXForCausalLM),
    "gpt_neox-sequential": (tf.GPTNeoXConfig, dict(num_hidden_layers=L, hidden_size=D, num_attention_heads=4,
                                                   intermediate_size=64, max_position_embeddings=64,
                                                   use_parallel_residual=False, tie_word_embeddings=True),
                            tf.GPTNeoXForCausalLM),
    "gpt_neo": (tf.GPTNeoConfig, dict(num_layers=L, hidden_size=D, num_heads=4, max_position_embeddings=64,
                                      attention_types=[[["global", "local"], 1]], window_size=8),
                tf.GPTNeoForCausalLM),
    "bloom": (tf.BloomConfig, dict(n_layer=L, hidden_size=D, n_head=4), tf.BloomForCausalLM),
    "phi": (tf.PhiConfig, dict(num_hidden_layers=L, hidden_size=D, num_attention_heads=4, intermediate_size=64,
                               max_position_embeddings=64), tf.PhiForCausalLM),
    "falcon-parallel": (tf.FalconConfig, dict(num_hidden_layers=L, hidden_size=D, num_attention_heads=4),
                        tf.FalconForCausalLM),
    "falcon-new": (tf.FalconConfig, dict(num_hidden_layers=L, hidden_size=D, num_attention_heads=4,
                                         new_decoder_architecture=True, num_kv_heads=2), tf.FalconForCausalLM),
    "falcon-sequential-alibi": (tf.FalconConfig, dict(num_hidden_layers=L, hidden_size=D, num_attention_heads=4,
                                                      parallel_attn=False, alibi=True, bias=True),
                                tf.FalconForCausalLM),
    "gptj": (tf.GPTJConfig, dict(n_layer=L, n_embd=D, n_head=4, rotary_dim=4, n_positions=64), tf.GPTJForCausalLM),
    # seq2seq; positions read inputs_embeds[..., -1] for its shape; shared, tied embeddings
    "mbart": (tf.MBartConfig, dict(d_model=D, encoder_layers=L, decoder_layers=L, encoder_attention_heads=4,
                                   decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                   max_position_embeddings=64), tf.MBartForConditionalGeneration),
    "codegen": (tf.CodeGenConfig, dict(n_layer=L, n_embd=D, n_head=4, rotary_dim=4, n_positions=64, n_ctx=64),
                tf.CodeGenForCausalLM),
}


@torch.no_grad()
def perturb(model: nn.Module, seed: int = 0) -> nn.Module:
    """Move weights far from init: LN gains/biases off 1/0, non-zero means in embeddings and projections."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    for m in model.modules():
        if isinstance(m, nn.LayerNorm) and m.weight is not None:
            m.weight.copy_(1 + 0.5 * rnd(m.weight.shape))
            if m.bias is not None:
                m.bias.copy_(0.5 + 0.5 * rnd(m.bias.shape))
        elif type(m).__name__.endswith("LayerScale"):
            for p in m.parameters():
                p.copy_(0.5 + rnd(p.shape))
        elif isinstance(m, nn.Embedding):
            m.weight.add_(0.5 * rnd(m.weight.shape[0], 1) + 0.3)       # per-row mean offsets
        elif isinstance(m, nn.Linear):
            m.weight.add_(0.1 * rnd(1, m.weight.shape[1]))              # mean along the output dim
        elif type(m).__name__ == "Conv1D":
            m.weight.add_(0.1 * rnd(m.weight.shape[0], 1))              # Conv1D is (in, out)
        if isinstance(m, nn.Linear) and m.bias is not None or type(m).__name__ == "Conv1D":
            m.bias.add_(0.1 * rnd(m.bias.shape) + 0.1)
    return model


def build(name: str, seed: int = 0) -> nn.Module:
    cfg_cls, kw, model_cls = FAMILIES[name]
    kw = {**COMMON, **kw}
    if kw["tie_word_embeddings"] is None:
        del kw["tie_word_embeddings"]
    torch.manual_seed(seed)
    return perturb(model_cls(cfg_cls(**kw)), seed).eval()


def padded_batches(seed: int = 1) -> list[dict]:
    """Batches of different lengths; the second is right-padded with per-row lengths 12, 7, 3."""
    g = torch.Generator().manual_seed(seed)
    single = {"input_ids": torch.randint(0, V, (1, 9), generator=g),
              "attention_mask": torch.ones(1, 9, dtype=torch.long)}
    ids = torch.randint(0, V, (3, 12), generator=g)
    mask = torch.zeros(3, 12, dtype=torch.long)
    for row, n in enumerate((12, 7, 3)):
        mask[row, :n] = 1
    ids[mask == 0] = 0
    return [single, {"input_ids": ids, "attention_mask": mask}]


def wav2vec2_config(**kw):
    """A tiny wav2vec2 config (its conv feature encoder turns a short waveform into a few frames)."""
    return tf.Wav2Vec2Config(vocab_size=32, hidden_size=D, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                             num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4, **kw)
