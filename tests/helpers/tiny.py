"""Tiny Hugging Face models built from configs, with parameters pushed far from their init.

Perturbed LayerNorm gains/biases and embeddings make dropping a bias change outputs measurably,
so a test that passes on them would fail on a conversion that silently did nothing.
"""
from __future__ import annotations

import os

import torch
import transformers
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers.logging.set_verbosity_error()

TINY = dict(hidden=32, layers=2, heads=4, vocab=97, positions=64)


def _config(family: str):
    h, n, a, v, p = TINY["hidden"], TINY["layers"], TINY["heads"], TINY["vocab"], TINY["positions"]
    if family == "gpt2":
        return transformers.GPT2Config(vocab_size=v, n_positions=p, n_embd=h, n_layer=n, n_head=a,
                                       bos_token_id=0, eos_token_id=0)
    if family == "opt":
        return transformers.OPTConfig(vocab_size=v, max_position_embeddings=p, hidden_size=h, num_hidden_layers=n,
                                      num_attention_heads=a, ffn_dim=4 * h, word_embed_proj_dim=h,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=1)
    if family == "gpt_neox":
        return transformers.GPTNeoXConfig(vocab_size=v, max_position_embeddings=p, hidden_size=h,
                                          num_hidden_layers=n, num_attention_heads=a, intermediate_size=4 * h,
                                          bos_token_id=0, eos_token_id=0)
    if family == "bert":
        return transformers.BertConfig(vocab_size=v, max_position_embeddings=p, hidden_size=h, num_hidden_layers=n,
                                       num_attention_heads=a, intermediate_size=4 * h, pad_token_id=0)
    if family == "vit":
        return transformers.ViTConfig(image_size=16, patch_size=8, num_channels=3, hidden_size=h,
                                      num_hidden_layers=n, num_attention_heads=a, intermediate_size=4 * h)
    if family == "llama":
        return transformers.LlamaConfig(vocab_size=v, max_position_embeddings=p, hidden_size=h, num_hidden_layers=n,
                                        num_attention_heads=a, num_key_value_heads=a, intermediate_size=4 * h,
                                        bos_token_id=0, eos_token_id=0)
    raise ValueError(family)


MODEL_CLASSES = {"gpt2": "GPT2LMHeadModel", "opt": "OPTForCausalLM", "gpt_neox": "GPTNeoXForCausalLM",
                 "bert": "BertModel", "vit": "ViTModel", "llama": "LlamaForCausalLM"}
FAMILIES = ["gpt2", "opt", "gpt_neox", "bert", "vit"]


@torch.no_grad()
def perturb(model: nn.Module, seed: int = 0) -> nn.Module:
    """Push LayerNorm gains/biases and embeddings far from init (deterministically)."""
    g = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, nn.LayerNorm):
            module.weight.copy_(0.5 + torch.rand(module.weight.shape, generator=g))
            module.bias.copy_(0.5 * torch.randn(module.bias.shape, generator=g) + 0.2)
        elif isinstance(module, nn.Embedding):
            module.weight.add_(0.3 + 0.5 * torch.randn(module.weight.shape, generator=g))
    return model


def tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    model = getattr(transformers, MODEL_CLASSES[family])(_config(family))
    return perturb(model, seed).to(dtype).eval()


def count_layernorms(model: nn.Module) -> int:
    return sum(isinstance(m, nn.LayerNorm) for m in model.modules())
