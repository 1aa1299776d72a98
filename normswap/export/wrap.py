"""Flat-tensor wrappers around models: what torch.onnx traces and what ONNX inputs/outputs are named.

HF models: names and axis names follow Optimum's ORTModelForCausalLM: input_ids, attention_mask, position_ids
(decoders), past_key_values.{i}.key/value -> logits (encoders: last_hidden_state),
present.{i}.key/value. The past is passed as plain tensors and turned into a transformers
DynamicCache inside forward, so no Cache object crosses the export boundary.

Any other module (`Flat`): called with the user's example batch, its tensors the graph's inputs (named by
keyword, nested ones dotted: `x`, `pair.0`), its outputs flattened as `parity.tensors` names them (`output`
for a lone tensor, `0`, `1` for a tuple, `logits`, `a.b` for a dict); every dim > 1 of an input dynamic
where the model allows it (torch.export's Dim.AUTO).
"""
from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.export import Dim

from normswap.models.introspect import config_int
from normswap.parity import tensors


def is_decoder(model: nn.Module) -> bool:
    """A decoder-only language model that `generate`s with a KV cache."""
    can = getattr(model, "can_generate", lambda: False)()
    return bool(can) and not getattr(model.config, "is_encoder_decoder", False)


def takes_positions(model: nn.Module) -> bool:
    """A decoder whose forward takes position_ids (BLOOM's ALiBi reads positions off the mask: no input)."""
    return is_decoder(model) and "position_ids" in inspect.signature(model.forward).parameters


def num_layers(config) -> int:
    layers = config_int(config, "layers")
    if layers is None:
        raise ValueError("cannot tell the number of layers from the config")
    return layers


@torch.no_grad()
def kv_shape(model: nn.Module, batch: int, length: int) -> tuple[int, int, int, int]:
    """(batch, kv heads, length, head dim) of one layer's cached keys, read off a 1-token forward: configs
    name kv heads in too many ways (Falcon's multi_query keeps one)."""
    ids = torch.zeros(1, 1, dtype=torch.long, device=next(model.parameters()).device)
    keys = cache_of(model(input_ids=ids, use_cache=True)).layers[0].keys
    return batch, keys.shape[1], length, keys.shape[3]


def cache_arg(model: nn.Module) -> str:
    """The name the model's forward gives its KV cache: `past_key_values` up to transformers 5.23, `cache`
    from 5.24 (which still takes the old name, with a deprecation warning)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_of(out):
    """The KV cache a forward returned, under either name."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def position_ids(attention_mask, length: int):
    """HF generate's positions for the last `length` tokens: cumsum(mask) - 1, 1 where padded.
    Works on torch tensors and numpy arrays."""
    pos = attention_mask.cumsum(-1) - 1
    pos[attention_mask == 0] = 1
    return pos[:, pos.shape[1] - length:]


class Plain(nn.Module):
    """(input_ids, attention_mask[, position_ids]) -> logits or last_hidden_state."""

    def __init__(self, model: nn.Module, output: str):
        super().__init__()
        self.model, self.output = model, output

    def forward(self, input_ids, attention_mask, position_ids=None):
        extra = {} if position_ids is None else {"position_ids": position_ids}
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **extra)
        return getattr(out, self.output)


class WithPast(nn.Module):
    """(input_ids, attention_mask over past + new tokens, [position_ids,] k0, v0, k1, ...)
    -> (logits, k0', v0', ...)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.layers = num_layers(model.config)
        self.positions = takes_positions(model)
        self.cache_arg = cache_arg(model)

    def forward(self, input_ids, attention_mask, *rest):
        from transformers import DynamicCache

        positions, past = (rest[0], rest[1:]) if self.positions else (None, rest)
        extra = {} if positions is None else {"position_ids": positions}
        cache = DynamicCache(ddp_cache_data=[(past[2 * i], past[2 * i + 1]) for i in range(self.layers)],
                             config=self.model.config)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True,
                         **{self.cache_arg: cache}, **extra)
        present = []
        for i in range(self.layers):
            layer = cache_of(out).layers[i]
            present += [layer.keys, layer.values]
        return (out.logits, *present)


def io_names(layers: int, with_past: bool, output: str, positions: bool = False) -> tuple[list[str], list[str]]:
    inputs, outputs = ["input_ids", "attention_mask"] + ["position_ids"] * positions, [output]
    for i in range(layers if with_past else 0):
        inputs += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
        outputs += [f"present.{i}.key", f"present.{i}.value"]
    return inputs, outputs


def axis_names(name: str, with_past: bool) -> dict[int, str]:
    """Optimum's dynamic axis names for one input or output."""
    total = "past_sequence_length + sequence_length"
    if name.startswith("past_key_values."):
        return {0: "batch_size", 2: "past_sequence_length"}
    if name.startswith("present."):
        return {0: "batch_size", 2: total}
    if name == "attention_mask" and with_past:
        return {0: "batch_size", 1: total}
    return {0: "batch_size", 1: "sequence_length"}


def name_axes(model, with_past: bool) -> None:
    """Rename the exporter's symbolic dims (s0, s1...) on graph inputs/outputs (an onnx_ir Model)."""
    import onnx_ir as ir

    for value in [*model.graph.inputs, *model.graph.outputs]:
        if value.shape is None:
            continue
        names = axis_names(value.name, with_past)
        dims = [ir.SymbolicDim(names[i]) if i in names and not isinstance(d, int) else d
                for i, d in enumerate(value.shape)]
        value.shape = ir.Shape(dims)


def example(model: nn.Module, with_past: bool, batch: int = 2, seq: int = 5, past: int = 3):
    """(args, dynamic_shapes) to trace with; sizes > 1 so nothing is specialised to a constant.
    Decoders that take position_ids get them (with or without the past)."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device=device)
    total = seq + (past if with_past else 0)
    mask = torch.ones(batch, total, dtype=torch.long, device=device)
    b, s = Dim("batch"), Dim("sequence")
    args, dyn = [ids, mask], [{0: b, 1: s}, {0: b, 1: Dim("total_sequence") if with_past else s}]
    rest, rest_dyn = [], []   # WithPast's *rest: [position_ids,] k0, v0, ... (one argument to torch.export)
    if takes_positions(model):
        rest.append(position_ids(mask, seq))
        rest_dyn.append({0: b, 1: s})
    if not with_past:
        return tuple(args + rest), tuple(dyn + rest_dyn)
    p = Dim("past_sequence", min=0)
    n = 2 * num_layers(model.config)
    rest += [torch.zeros(kv_shape(model, batch, past), device=device, dtype=dtype) for _ in range(n)]
    rest_dyn += [{0: b, 2: p} for _ in range(n)]
    return tuple(args + rest), tuple(dyn + [tuple(rest_dyn)])


def flat_inputs(batch: dict) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) for each tensor of a batch of keyword arguments, in `parity.tensors` order."""
    return list(tensors(batch))


def substitute(value, flat):
    """`value` with each tensor replaced by the next one of the iterator `flat` (in `parity.tensors` order)."""
    if isinstance(value, torch.Tensor):
        return next(flat)
    if isinstance(value, dict):
        return {k: substitute(v, flat) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        items = [substitute(v, flat) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


class Flat(nn.Module):
    """(tensor, ...) -> (tensor, ...): `model` called with `batch`, its tensors replaced by the inputs (anything
    else in it is a constant of the graph), its output's tensors in `parity.tensors` order."""

    def __init__(self, model: nn.Module, batch: dict):
        super().__init__()
        self.model, self.batch = model, batch

    def forward(self, *flat):
        return tuple(t for _, t in tensors(self.model(**substitute(self.batch, iter(flat)))))


@torch.no_grad()
def output_names(model: nn.Module, batch: dict) -> list[str]:
    """The names `Flat` gives `model`'s outputs on `batch`: `output` for a lone tensor, else dotted keys."""
    return [name or "output" for name, _ in tensors(model(**batch))]


def auto_shapes(flat: tuple, axes: list[tuple[int, ...]] | None = None) -> tuple:
    """dynamic_shapes for `Flat`'s *inputs: every dim > 1 automatic (dynamic unless the model fixes it), or, with
    `axes`, only those of each input's axes."""
    return (tuple({i: Dim.AUTO for i, n in enumerate(t.shape) if n > 1 and (axes is None or i in axes[k])}
                  for k, t in enumerate(flat)),)
