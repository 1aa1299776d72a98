"""Fused residual add + RMSNorm ("add & norm") for converted models (opt-in: `fuse_residual_norms(model)`).

In a pre-norm GPT-2 block the attention output is added to the residual stream and the sum is
immediately normalised by ln_2. Passing both to the norm (`norm(x, residual=r)` -> (RMSNorm(x + r),
x + r)) lets the Triton kernel do the add and the norm in one pass: one read of the sum saved.
The block's class is swapped for a subclass whose forward makes that call; weights, names and
state_dict are untouched, and `unfuse_residual_norms` swaps back.
"""
from __future__ import annotations

import functools
import inspect

from torch import nn

from normswap.errors import NormswapError
from normswap.norms import RMSNorm

__all__ = ["fuse_residual_norms", "unfuse_residual_norms"]

# The GPT2Block.forward parameters the fused forward re-implements: the cache is `past_key_values` up to
# transformers 5.23 and `cache` from 5.24 (the fused forward takes whichever the block takes).
_GPT2_PARAMS = ("hidden_states", "past_key_values", "attention_mask", "encoder_hidden_states",
                "encoder_attention_mask", "use_cache")
_CACHE_NAMES = ("past_key_values", "cache")


@functools.cache   # one fused class per block class: fused modules of one model share it
def _fused_class(cls: type) -> type:
    return type(f"Fused{cls.__name__}", (cls,), {"forward": _fused_gpt2_forward(_cache_name(cls)),
                                                  "__module__": __name__, "_normswap_unfused": cls})


def _fused_gpt2_forward(cache_name: str):
    """GPT2Block.forward with each `residual + sublayer(...)` folded into the next norm's call; its second
    parameter (the cache) named as the block names it."""
    def forward(self, hidden_states, past=None, attention_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None, use_cache=False, **kwargs):
        past = kwargs.pop(cache_name, past)
        residual = hidden_states
        attn_output, _ = self.attn(self.ln_1(hidden_states), attention_mask=attention_mask, use_cache=use_cache,
                                   **{cache_name: past}, **kwargs)
        if encoder_hidden_states is not None:
            if not hasattr(self, "crossattention"):
                raise ValueError(f"If `encoder_hidden_states` are passed, {self} has to be instantiated with "
                                 "cross-attention layers by setting `config.add_cross_attention=True`")
            normed, residual = self.ln_cross_attn(attn_output, residual=residual)
            attn_output, _ = self.crossattention(normed, attention_mask=attention_mask,
                                                 encoder_hidden_states=encoder_hidden_states,
                                                 encoder_attention_mask=encoder_attention_mask,
                                                 **{cache_name: past})
        normed, residual = self.ln_2(attn_output, residual=residual)
        return residual + self.mlp(normed)
    return forward


def _is_gpt2_block(module: nn.Module) -> bool:
    try:
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    except ImportError:  # transformers without GPT-2: nothing to fuse
        return False
    return isinstance(module, GPT2Block)


def _cache_name(cls: type) -> str:
    """The name GPT2Block.forward gives its cache; refused if its parameters are not the ones re-implemented."""
    params = tuple(inspect.signature(cls.forward).parameters)[1:1 + len(_GPT2_PARAMS)]
    for name in _CACHE_NAMES:
        if params == tuple(name if p == "past_key_values" else p for p in _GPT2_PARAMS):
            return name
    raise NormswapError(f"{cls.__name__}.forward takes {params}, not the {_GPT2_PARAMS} the fused block "
                        "re-implements: this transformers version is not supported by fuse_residual_norms")


def _fusable(block: nn.Module) -> bool:
    norms = [block.ln_2] + ([block.ln_cross_attn] if hasattr(block, "crossattention") else [])
    return all(isinstance(n, RMSNorm) for n in norms)


def fuse_residual_norms(model: nn.Module) -> list[str]:
    """Make every GPT-2 block whose post-attention norms are normswap RMSNorms use the fused add+norm.

    Returns the names of the fused blocks (already-fused blocks included; others are left alone).
    Same outputs as the unfused model; faster only where the Triton backend runs (CUDA).
    """
    fused = []
    for name, module in model.named_modules():
        if getattr(type(module), "_normswap_unfused", None) is not None:
            fused.append(name)
            continue
        if not _is_gpt2_block(module) or not _fusable(module):
            continue
        module.__class__ = _fused_class(type(module))
        fused.append(name)
    return fused


def unfuse_residual_norms(model: nn.Module) -> int:
    """Undo `fuse_residual_norms`; returns how many blocks were restored."""
    n = 0
    for module in model.modules():
        original = getattr(type(module), "_normswap_unfused", None)
        if original is not None:
            module.__class__ = original
            n += 1
    return n
