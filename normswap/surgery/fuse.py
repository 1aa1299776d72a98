"""Fused residual add + RMSNorm for converted models (opt-in: `fuse_residual_norms(model)`).

In a pre-norm GPT-2 block the attention output is added to the residual stream and the sum is
immediately normalised by ln_2. Passing both to the norm (`norm(x, residual=r)` -> (RMSNorm(x + r),
x + r)) lets the Triton kernel do the add and the norm in one pass: one read of the sum saved.
The block's class is swapped for a subclass whose forward makes that call; weights, names and
state_dict are untouched, and `unfuse_residual_norms` swaps back.
"""
from __future__ import annotations

import inspect

from torch import nn

from normswap.errors import NormswapError
from normswap.norms import RMSNorm

__all__ = ["fuse_residual_norms", "unfuse_residual_norms"]

# The GPT2Block.forward parameters the fused forward re-implements (transformers 4.5x-5.x).
_GPT2_PARAMS = ("hidden_states", "past_key_values", "attention_mask", "encoder_hidden_states",
                "encoder_attention_mask", "use_cache")
_fused_classes: dict[type, type] = {}


def _fused_gpt2_forward(self, hidden_states, past_key_values=None, attention_mask=None,
                        encoder_hidden_states=None, encoder_attention_mask=None, use_cache=False, **kwargs):
    """GPT2Block.forward with each `residual + sublayer(...)` folded into the next norm's call."""
    residual = hidden_states
    attn_output, _ = self.attn(self.ln_1(hidden_states), past_key_values=past_key_values,
                               attention_mask=attention_mask, use_cache=use_cache, **kwargs)
    if encoder_hidden_states is not None:
        if not hasattr(self, "crossattention"):
            raise ValueError(f"If `encoder_hidden_states` are passed, {self} has to be instantiated with "
                             "cross-attention layers by setting `config.add_cross_attention=True`")
        normed, residual = self.ln_cross_attn(attn_output, residual=residual)
        attn_output, _ = self.crossattention(normed, past_key_values=past_key_values,
                                             attention_mask=attention_mask,
                                             encoder_hidden_states=encoder_hidden_states,
                                             encoder_attention_mask=encoder_attention_mask)
    normed, residual = self.ln_2(attn_output, residual=residual)
    return residual + self.mlp(normed)


def _is_gpt2_block(module: nn.Module) -> bool:
    try:
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    except ImportError:  # transformers without GPT-2: nothing to fuse
        return False
    return isinstance(module, GPT2Block)


def _check_signature(cls: type) -> None:
    params = tuple(inspect.signature(cls.forward).parameters)[1:1 + len(_GPT2_PARAMS)]
    if params != _GPT2_PARAMS:
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
        if type(module) in _fused_classes.values():
            fused.append(name)
            continue
        if not _is_gpt2_block(module) or not _fusable(module):
            continue
        cls = type(module)
        if cls not in _fused_classes:
            _check_signature(cls)
            _fused_classes[cls] = type(f"Fused{cls.__name__}", (cls,),
                                       {"forward": _fused_gpt2_forward, "__module__": __name__,
                                        "_normswap_unfused": cls})
        module.__class__ = _fused_classes[cls]
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
