"""Flat-tensor wrappers around HF models: what torch.onnx traces and what ONNX inputs/outputs are named.

Names follow Optimum: input_ids, attention_mask, past_key_values.{i}.key/value -> logits (encoders:
last_hidden_state), present.{i}.key/value. The past is passed as plain tensors and turned into a
transformers DynamicCache inside forward, so no Cache object crosses the export boundary.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.export import Dim


def is_decoder(model: nn.Module) -> bool:
    """A decoder-only language model that `generate`s with a KV cache."""
    can = getattr(model, "can_generate", lambda: False)()
    return bool(can) and not getattr(model.config, "is_encoder_decoder", False)


def num_layers(config) -> int:
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        if isinstance(getattr(config, key, None), int):
            return getattr(config, key)
    raise ValueError("cannot tell the number of layers from the config")


def kv_shape(config, batch: int, length: int) -> tuple[int, int, int, int]:
    """(batch, kv heads, length, head dim) of one layer's cached keys."""
    heads = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", None) \
        or config.n_head
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    head_dim = getattr(config, "head_dim", None) or hidden // (getattr(config, "num_attention_heads", None)
                                                               or config.n_head)
    return batch, heads, length, head_dim


class Plain(nn.Module):
    """(input_ids, attention_mask) -> logits or last_hidden_state."""

    def __init__(self, model: nn.Module, output: str):
        super().__init__()
        self.model, self.output = model, output

    def forward(self, input_ids, attention_mask):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return getattr(out, self.output)


class WithPast(nn.Module):
    """(input_ids, attention_mask over past + new tokens, k0, v0, k1, ...) -> (logits, k0', v0', ...)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.layers = num_layers(model.config)

    def forward(self, input_ids, attention_mask, *past):
        from transformers import DynamicCache

        cache = DynamicCache(ddp_cache_data=[(past[2 * i], past[2 * i + 1]) for i in range(self.layers)],
                             config=self.model.config)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache,
                         use_cache=True)
        present = []
        for i in range(self.layers):
            layer = out.past_key_values.layers[i]
            present += [layer.keys, layer.values]
        return (out.logits, *present)


def io_names(layers: int, with_past: bool, output: str) -> tuple[list[str], list[str]]:
    inputs, outputs = ["input_ids", "attention_mask"], [output]
    for i in range(layers if with_past else 0):
        inputs += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
        outputs += [f"present.{i}.key", f"present.{i}.value"]
    return inputs, outputs


def example(model: nn.Module, with_past: bool, batch: int = 2, seq: int = 5, past: int = 3):
    """(args, dynamic_shapes) to trace with; sizes > 1 so nothing is specialised to a constant."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=device)
    total = seq + (past if with_past else 0)
    mask = torch.ones(batch, total, dtype=torch.long, device=device)
    args = [ids, mask]
    b, s = Dim("batch"), Dim("sequence")
    if not with_past:
        return tuple(args), ({0: b, 1: s}, {0: b, 1: s})
    p = Dim("past_sequence", min=0)
    n = 2 * num_layers(model.config)  # torch.export sees *past as one tuple argument
    args += [torch.zeros(kv_shape(model.config, batch, past), device=device, dtype=dtype) for _ in range(n)]
    dyn = ({0: b, 1: s}, {0: b, 1: Dim("total_sequence")}, tuple({0: b, 2: p} for _ in range(n)))
    return tuple(args), tuple(dyn)
