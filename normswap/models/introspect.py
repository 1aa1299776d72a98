"""What a model is, read off its config and modules: sizes under their many config names, norm kinds, heads.

One place for the aliases transformers configs use for the same size, and one classifier of norm modules,
so that every part of normswap reads a model the same way. Needs torch only (no transformers).
"""
from __future__ import annotations

from torch import nn

# Config attribute names of the same quantity across architectures, most common first.
ALIASES = {
    "hidden": ("hidden_size", "d_model", "n_embd", "hidden_dim"),
    "layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "positions": ("n_positions", "max_position_embeddings", "n_ctx", "seq_length"),
    "heads": ("num_attention_heads", "n_head"),
}


def config_int(config, kind: str) -> int | None:
    """The first integer among `kind`'s aliases on `config` (e.g. config_int(c, "hidden")), else None."""
    for key in ALIASES[kind]:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def norm_kind(module: nn.Module) -> str | None:
    """"rmsnorm" (ours, nn.RMSNorm, LlamaRMSNorm, T5LayerNorm...), "layernorm" (nn.LayerNorm and
    subclasses, leaf modules whose class says LayerNorm), "norm" (other normalisation layers: GroupNorm,
    BatchNorm, leaf *Norm classes), or None. By class only; `surgery.probe` decides by behaviour."""
    name = type(module).__name__
    leaf = next(module.children(), None) is None
    if isinstance(module, nn.RMSNorm) or "RMSNorm" in name or name == "T5LayerNorm":
        return "rmsnorm"
    # a LayerNorm class has no submodules (Wav2Vec2LayerNormConvLayer is a block, not a norm)
    if isinstance(module, nn.LayerNorm) or leaf and "layernorm" in name.lower():
        return "layernorm"
    if isinstance(module, (nn.GroupNorm, nn.modules.batchnorm._NormBase)) or leaf and "Norm" in name:
        return "norm"
    return None


def is_rms_norm(module: nn.Module) -> bool:
    """True for ours and for other libraries' RMSNorms (LlamaRMSNorm, T5LayerNorm, nn.RMSNorm...)."""
    return norm_kind(module) == "rmsnorm"


def is_causal_lm(model_or_config) -> bool:
    """True for a causal LM: its class or config.architectures ends in ...ForCausalLM / ...LMHeadModel."""
    config = getattr(model_or_config, "config", model_or_config)
    names = list(getattr(config, "architectures", None) or [])
    if isinstance(model_or_config, nn.Module):
        names.append(type(model_or_config).__name__)
    return any(n.endswith(("ForCausalLM", "LMHeadModel")) for n in names)


def is_conv1d(layer: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2): a linear layer whose weight is stored (in, out)."""
    return type(layer).__name__ == "Conv1D"


def is_linear(layer: nn.Module) -> bool:
    return isinstance(layer, nn.Linear) or is_conv1d(layer)


def out_width(module: nn.Module) -> int:
    """The output width of a linear layer (GPT-2 Conv1D too); -1 for other modules."""
    if isinstance(module, nn.Linear):
        return module.out_features
    return module.weight.shape[1] if is_conv1d(module) else -1


def is_scale(module: nn.Module) -> bool:
    """A per-channel scale (LayerScale): one 1-D parameter, not a linear layer or an embedding."""
    params = list(module.parameters(recurse=False))
    return len(params) == 1 and params[0].dim() == 1 and not isinstance(module, (nn.Linear, nn.Embedding))


def in_width(module: nn.Module) -> int:
    """The input width of a linear layer (GPT-2 Conv1D too); -1 for other modules."""
    if isinstance(module, nn.Linear):
        return module.in_features
    return module.weight.shape[0] if is_conv1d(module) else -1


def floating_buffers(model: nn.Module) -> dict[str, bool]:
    """The model's floating-point buffers of more than one value, each once by name -> persistent (saved in
    the state dict and loaded from it; a non-persistent one is rebuilt by the model's own code). Integer and
    bool buffers are indices and masks, a single value is a scalar: neither carries channels."""
    out = {}
    for name, buf in model.named_buffers():
        if buf.is_floating_point() and buf.numel() > 1:
            owner, _, attr = name.rpartition(".")
            out[name] = attr not in model.get_submodule(owner)._non_persistent_buffers_set
    return out
