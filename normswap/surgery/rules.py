"""What a torch operation does to the hidden-dim mean of the tensors the trace follows.

A `Flow` describes a followed tensor: the labels (layer outputs, parameters, norm outputs) it is a linear
combination of, and where their channels are. It is *pure* when every row along the hidden dim combines
rows of the labels with weights that do not depend on the channel: then centring each label (per group of
channels) centres the tensor. The rules, by what an operation does to the values, not by its name alone:

- rearrangements (views, permutes, indexing, gathers, rolls, flips, zero pads, cat/stack/split, embedding
  lookups, dtype casts, dropout in eval, masked_fill/where with 0, x[i] = v, masked_scatter): elements move, none
  changes. Found by running the same operation on integer *codes* (part, row, channel) of the elements:
  the result is *intact* (one dim holds whole rows, channels in order: `hd`) or *mapped* (`codes` say
  which channel of which row each element is: q/k/v slices of a fused projection, cat along the hidden dim);
- sums and differences of pure tensors laid out alike; zeros (torch.zeros...) add nothing;
- scaling by a factor constant along the hidden dim (a scalar, a per-token weight), or by a per-channel
  parameter (a *scale*: folded into the one layer it scales, as LayerScale);
- means, sums, average pools, interpolation, matrix products and einsums over other dims with weights that
  do not depend on the channel (token pooling, attention pooling, per-token expert weights), and
  index_add / scatter_add of whole rows (mixture-of-experts outputs).
Anything else is opaque: its output carries no zero-mean promise (`opaque` names the operation).
"""
from __future__ import annotations

import torch

from normswap.surgery.flow import ZERO, Flow, canonical, codes_of

# Calls that only look at a tensor's shape, dtype or device: neither a use nor a new value.
IGNORE = {"empty_like", "ones_like", "full_like", "new_ones", "new_empty", "new_full", "new_tensor", "size",
          "dim", "numel", "is_floating_point", "__len__", "get_device", "is_complex", "element_size"}
IDENTITY = {"to", "float", "half", "bfloat16", "double", "type", "type_as", "detach", "contiguous", "clone",
            "requires_grad_", "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
            "feature_alpha_dropout", "__get__.data"}
MOVE = {"view", "reshape", "permute", "transpose", "swapaxes", "swapdims", "movedim", "moveaxis", "t",
        "expand", "expand_as", "broadcast_to", "repeat", "tile", "repeat_interleave", "flatten", "unflatten",
        "squeeze", "unsqueeze", "view_as", "reshape_as", "__getitem__", "narrow", "select", "index_select",
        "gather", "take_along_dim", "split", "split_with_sizes", "chunk", "unbind", "tensor_split", "cat",
        "concat", "concatenate", "stack", "roll", "flip", "fliplr", "flipud", "unfold", "pad", "masked_fill",
        "masked_fill_", "where", "__setitem__", "index_put", "index_put_", "embedding", "copy_", "__get__.T",
        "__get__.mT", "masked_scatter", "masked_scatter_"}
SUM = {"add", "__add__", "__radd__", "__iadd__", "add_", "sub", "__sub__", "__rsub__", "__isub__", "sub_"}
SCALE = {"mul", "__mul__", "__rmul__", "__imul__", "mul_", "div", "__truediv__", "__itruediv__", "div_",
         "neg", "__neg__", "negative"}
REDUCE = {"mean", "sum", "nansum", "nanmean"}
POOL = {"avg_pool1d": 1, "avg_pool2d": 2, "avg_pool3d": 3, "adaptive_avg_pool1d": 1, "adaptive_avg_pool2d": 2,
        "adaptive_avg_pool3d": 3}
RESAMPLE = {"interpolate", "upsample", "upsample_bilinear", "upsample_nearest"}
MATMUL = {"matmul", "__matmul__", "__rmatmul__", "bmm", "mm"}
ACCUMULATE = {"index_add", "index_add_", "scatter_add", "scatter_add_"}
ZEROS = {"zeros", "zeros_like", "new_zeros"}
CLAMP = {"clamp", "clip", "clamp_", "clip_"}
PRODUCTS = {"linear", "matmul", "__matmul__", "bmm", "mm", "_grouped_mm", "grouped_mm", "grouped_mm_fallback"}
# Moves whose other tensor arguments are indices, masks or zeros, not values moved.
INDEXED = {"__getitem__", "index_select", "gather", "take_along_dim", "masked_fill", "masked_fill_", "where",
           "__setitem__", "index_put", "index_put_", "embedding", "repeat_interleave", "roll", "pad", "unfold",
           "expand_as", "view_as", "reshape_as", "masked_scatter", "masked_scatter_"}


def _substitute(obj, table: dict[int, torch.Tensor]):
    if isinstance(obj, torch.Tensor):
        return table.get(id(obj), obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_substitute(o, table) for o in obj)
    if isinstance(obj, dict):
        return {k: _substitute(v, table) for k, v in obj.items()}
    return obj


def _fills_zero(name: str, args, kwargs, followed: set[int]) -> bool:
    """The constants a rearrangement writes are zeros (pad value, masked_fill value, where's other side)."""
    if name == "pad":
        mode = kwargs.get("mode", args[2] if len(args) > 2 else "constant")
        value = kwargs.get("value", args[3] if len(args) > 3 else None)
        return mode == "constant" and not value
    if name.startswith("masked_fill"):
        value = kwargs.get("value", args[2] if len(args) > 2 else None)
        return isinstance(value, (int, float)) and value == 0 or \
            isinstance(value, torch.Tensor) and value.numel() == 1 and not bool(value.any())
    if name == "where":
        sides = _where_sides(args, kwargs)
        return all(id(s) in followed or _zero(s) for s in sides) and len(sides) == 2
    if name in ("__setitem__", "index_put", "index_put_"):
        value = args[2] if len(args) > 2 else kwargs.get("values")
        accumulate = kwargs.get("accumulate", args[3] if name != "__setitem__" and len(args) > 3 else False)
        return not accumulate and (isinstance(value, (int, float)) and value == 0 or id(value) in followed)
    if name == "copy_":
        return id(args[1]) in followed
    return True


def _zero(value) -> bool:
    """A constant zero: a number, or a tensor the trace does not follow holding only zeros (`einx.where(m, h, 0.)`
    runs `where(m, h, asarray(0.).reshape(1, 1, 1))`)."""
    if isinstance(value, torch.Tensor):
        return not bool(value.any())
    return isinstance(value, (int, float)) and value == 0


def _where_sides(args, kwargs) -> list:
    return list(args[1:3]) + [kwargs[k] for k in ("input", "other") if k in kwargs]


def _integer_zeros(name: str, args, kwargs, table: dict[int, torch.Tensor], followed: set[int]):
    """where's constant zero sides as integer zeros (the codes are integers: a float zero would make the result
    float), given in `table` (tensors) or in the returned args (numbers)."""
    if name != "where":
        return args, kwargs
    for side in _where_sides(args, kwargs):
        if isinstance(side, torch.Tensor) and id(side) not in followed:
            table[id(side)] = torch.zeros(side.shape, dtype=torch.long, device=side.device)
    ints = tuple(0 if i in (1, 2) and isinstance(a, float) else a for i, a in enumerate(args))
    return ints, {k: 0 if k in ("input", "other") and isinstance(v, float) else v for k, v in kwargs.items()}


RESHAPE = {"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as", "reshape_as"}
BROADCAST = {"expand", "expand_as", "broadcast_to", "repeat", "tile"}
LEADING = {"narrow", "select", "index_select", "split", "split_with_sizes", "chunk", "unbind", "tensor_split"}


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _leading_index(index, hp: int) -> bool:
    """x[index] indexes only dims before hp (the hidden dim stays last-but-as-many)."""
    index = index if isinstance(index, tuple) else (index,)
    if any(i is Ellipsis for i in index):
        return False
    used = sum(i.dim() if isinstance(i, torch.Tensor) and i.dtype == torch.bool else 0 if i is None else 1
               for i in index)
    return used <= hp


def _fast(name: str, args, kwargs, x: torch.Tensor, f: Flow, outs: list) -> list[Flow] | None:
    """Shape arithmetic for the common moves of an intact tensor (no codes needed); None: use codes."""
    if f.codes is None and f.zero:
        return [f] * len(outs)
    if f.codes is not None or args[0] is not x:
        return None
    hp, w = x.dim() + f.hd, x.shape[f.hd]
    tail = x.dim() - hp
    keep = [Flow(f.labels, hd=f.hd, plain=f.plain)] * len(outs)
    out = outs[0]
    if name in RESHAPE and len(outs) == 1:
        after = _prod(x.shape[hp + 1:])
        for j in range(out.dim() - 1, -1, -1):
            if out.shape[j] == w and _prod(out.shape[j + 1:]) == after:
                return [Flow(f.labels, hd=j - out.dim(), plain=f.plain)]
        return None
    if name in BROADCAST and len(outs) == 1:
        return keep if out.dim() >= tail and list(out.shape[out.dim() - tail:]) == list(x.shape[hp:]) else None
    if name in ("permute", "transpose", "swapaxes", "swapdims", "movedim", "moveaxis") and len(outs) == 1:
        dims = list(range(x.dim()))
        if name == "permute":
            dims = list(args[1:]) if len(args) > 2 or isinstance(args[1], int) else list(args[1])
        elif name in ("transpose", "swapaxes", "swapdims"):
            a, b = (d % x.dim() for d in args[1:3])
            dims[a], dims[b] = dims[b], dims[a]
        else:
            return None
        j = [d % x.dim() for d in dims].index(hp)
        return [Flow(f.labels, hd=j - x.dim(), plain=f.plain)]
    if name == "__getitem__":
        return keep if _leading_index(args[1], hp) and out.dim() >= tail and out.shape[-tail] == w else None
    if name in LEADING:
        dim = kwargs.get("dim", args[2] if name in ("split", "split_with_sizes", "chunk", "tensor_split") and
                         len(args) > 2 else args[1] if name in ("narrow", "select", "index_select") else 0)
        if name in ("split", "split_with_sizes", "chunk", "tensor_split") and "dim" not in kwargs and len(args) < 3:
            dim = 0
        if isinstance(dim, int) and dim % x.dim() < hp:
            return keep
    return None


def rearranged(func, name: str, args, kwargs, ins: list, outs: list) -> list[Flow] | str:
    """The flows of `outs` after the rearrangement `func`, from `ins` [(tensor, flow)] (all pure); or why not."""
    if not _fills_zero(name, args, kwargs, {id(x) for x, _ in ins}):
        return f"{name} with a non-zero constant"
    if len(ins) == 1 and (fast := _fast(name, args, kwargs, *ins[0], outs)) is not None:
        return fast
    table, parts = {}, []
    for x, f in ins:
        c, p = codes_of(x, f, len(parts))
        table[id(x)], parts = c, parts + p
    inplace = name.endswith("_") and not name.endswith("__") or name == "__setitem__"
    if inplace:
        table[id(args[0])] = table[id(args[0])].clone()
    args, kwargs = _integer_zeros(name, args, kwargs, table, {id(x) for x, _ in ins})
    try:
        result = func(*_substitute(args, table), **_substitute(kwargs, table))
    except Exception:   # an operation the codes cannot follow
        return name
    results = [table[id(args[0])]] if inplace else _tensors(result)
    if len(results) != len(outs) or any(r.shape != o.shape or r.is_floating_point() for r, o in zip(results, outs)):
        return name   # not a move of the codes (a float result: a constant the codes cannot carry)
    plain = all(f.plain for _, f in ins)
    return [canonical(r, parts, plain) for r in results]


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    return []


def _unaligned(live: list) -> str:
    """Why a sum is opaque whose parts lay their channels out differently, naming what each part holds."""
    parts = sorted({label.ref or "the input" for _, f in live for label in f.labels})
    return "a sum of differently laid out values (" + ", ".join(parts) + ")"


def combined(ins: list, out: torch.Tensor) -> Flow | str:
    """The flow of a sum of the pure `ins` [(tensor, flow)] giving `out`; or why it is not pure."""
    live = [(x, f) for x, f in ins if not f.zero]
    if not live:
        return ZERO
    labels = frozenset().union(*(f.labels for _, f in live))
    if all(f.codes is None for _, f in live):
        hds = {f.hd for _, f in live}
        if len(hds) == 1:
            hd = hds.pop()
            if all(x.dim() >= -hd and x.shape[hd] == out.shape[hd] for x, _ in live):
                return Flow(labels, hd=hd, plain=False)
        return _unaligned(live)
    first, f0 = live[0]
    c0 = codes_of(first, f0, 0)[0].expand(out.shape)
    for x, f in live[1:]:
        same = f.codes is not None and len(f.parts) == len(f0.parts)
        if not same or not torch.equal(codes_of(x, f, 0)[0].expand(out.shape), c0):
            return _unaligned(live)
    parts = tuple((frozenset().union(*(f.parts[i][0] for _, f in live)), w) for i, (_, w) in enumerate(f0.parts))
    return Flow(labels, hd=None, codes=c0, parts=parts, plain=False)


def _const_along(factor: torch.Tensor | float, out: torch.Tensor, hd: int) -> bool:
    """The factor does not vary along out's dim hd (it broadcasts there, or is a number)."""
    if not isinstance(factor, torch.Tensor) or factor.numel() == 1:
        return True
    return factor.dim() < -hd or factor.shape[hd] == 1


def channel_scale(factor: torch.Tensor, fflow: Flow | None, out: torch.Tensor, hd: int | None) -> bool:
    """The factor is one parameter laid along the hidden dim only (LayerScale written as `lambda * x`)."""
    if fflow is None or not fflow.pure or fflow.codes is not None or len(fflow.labels) != 1 or hd is None:
        return False
    label = next(iter(fflow.labels))
    shape = [1] * (out.dim() - factor.dim()) + list(factor.shape)
    return label.kind == "param" and fflow.hd is not None and fflow.hd == hd and \
        shape[hd] == out.shape[hd] and all(s == 1 for i, s in enumerate(shape) if i != out.dim() + hd)


def scaled(name: str, args, ins: list, others: list, out: torch.Tensor) -> Flow | str:
    """A pure tensor times (or over) factors that are untracked or opaque; or why it is not pure."""
    if len(ins) != 1:
        return f"{name} of two followed tensors"
    x, f = ins[0]
    if name.startswith(("div", "__truediv", "__itruediv")) and args[0] is not x:
        return f"{name} by a followed tensor"
    hd = f.hd if f.codes is None else None
    if all(not isinstance(o, torch.Tensor) or o.numel() == 1 for o in others) or \
            hd is not None and all(_const_along(o, out, hd) for o in others):
        return Flow(f.labels, hd=f.hd, codes=f.codes, parts=f.parts, plain=False)
    return f"{name} by a per-channel tensor"


def _norm_dims(dims, ndim: int) -> set[int]:
    dims = [dims] if isinstance(dims, int) else list(dims)
    return {d % ndim for d in dims}


def mixed(name: str, args, kwargs, ins: list, others: list, out: torch.Tensor) -> Flow | str:
    """Weighted sums over non-hidden dims (means, pools, matrix products...); or why it is not pure."""
    live = [(x, f) for x, f in ins if not f.zero]
    if any(f.codes is not None for _, f in live):
        return f"{name} of a rearranged hidden dim"
    if not live:
        return ZERO
    x, f = live[0]
    hp = x.dim() + f.hd
    if name in REDUCE:
        dims = kwargs.get("dim", args[1] if len(args) > 1 and not isinstance(args[1], torch.dtype) else None)
        if dims is None or hp in _norm_dims(dims, x.dim()):
            return f"{name} over the hidden dim"
        keep = kwargs.get("keepdim", args[2] if len(args) > 2 and isinstance(args[2], bool) else False)
        hd = f.hd if keep else hp - sum(d < hp for d in _norm_dims(dims, x.dim())) - out.dim()
    elif name in POOL:
        if f.hd >= -POOL[name]:
            return f"{name} over the hidden dim"
        hd = f.hd
    elif name in RESAMPLE:
        if hp != 1:
            return f"{name} over the hidden dim"
        hd = f.hd
    elif name in MATMUL:
        if len(live) != 1 or any(isinstance(o, torch.Tensor) and o.dim() < 2 for o in others) or x.dim() < 2:
            return f"{name} of two followed tensors" if len(live) != 1 else name
        right = x is not args[0]
        if right and f.hd != -1 or not right and f.hd != -2:
            return f"{name} over the hidden dim"
        hd = f.hd
    elif name == "einsum":
        return _einsum(args, ins, out)
    else:   # ACCUMULATE: whole rows added into whole rows
        hds = {g.hd for _, g in live}
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        if len(hds) != 1 or not isinstance(dim, int) or dim % x.dim() == hp:
            return f"{name} along the hidden dim"
        if name.startswith("scatter_add"):
            index = kwargs.get("index", args[2])
            if not bool((index == index.narrow(hp, 0, 1)).all()):
                return f"{name} with an index that varies along the hidden dim"
        labels = frozenset().union(*(g.labels for _, g in live))
        return Flow(labels, hd=f.hd, plain=False)
    return Flow(f.labels, hd=hd, plain=False)


def _einsum(args, ins: list, out: torch.Tensor) -> Flow | str:
    eq = args[0].replace(" ", "") if isinstance(args[0], str) else ""
    operands = list(args[1:]) if len(args) > 2 or not isinstance(args[1], (list, tuple)) else list(args[1])
    if "->" not in eq or "." in eq or len(ins) != 1:
        return "einsum"
    lhs, rhs = eq.split("->")
    subs = lhs.split(",")
    x, f = ins[0]
    i = next((k for k, o in enumerate(operands) if o is x), None)
    if i is None or f.codes is not None or len(subs) != len(operands):
        return "einsum"
    letter = subs[i][f.hd]
    if subs[i].count(letter) != 1 or letter not in rhs or any(letter in s for k, s in enumerate(subs) if k != i):
        return "einsum over the hidden dim"
    return Flow(f.labels, hd=rhs.index(letter) - len(rhs), plain=False)


def overflow_guard(args, kwargs) -> bool:
    """clamp(x, -m, m) with m near the dtype's largest value (BART-family encoders in fp16): the identity on
    every value that is not already an overflow, so not an operation on the stream's values."""
    x = args[0] if args and isinstance(args[0], torch.Tensor) else None
    lo = kwargs.get("min", args[1] if len(args) > 1 else None)
    hi = kwargs.get("max", args[2] if len(args) > 2 else None)
    if x is None or not x.is_floating_point() or (lo is None and hi is None):
        return False
    big = torch.finfo(x.dtype).max / 2
    return all(b is None or isinstance(b, (int, float)) and abs(b) >= big for b in (lo, hi)) and \
        (lo is None or lo < 0) and (hi is None or hi > 0)


def carried(name: str, dark, tracked: list, outs: list) -> frozenset | None:
    """The labels whose per-row shift (along the last dim) an opaque sum carries unchanged, for their use to
    wait until it is read: a LayerNorm reading it is blind to that shift (one kept: attention without an output
    projection, x + softmax(q k) v); anything else reading it uses them then. None: used now (any other
    operation, a value laid out otherwise)."""
    if not isinstance(dark, Flow) or len(outs) != 1 or name not in SUM and name not in IDENTITY:
        return None
    out = outs[0]
    if out.dim() == 0 or any(f.pure and not f.zero and (f.codes is not None or f.hd != -1 or
                                                        x.shape[-1] != out.shape[-1]) for x, f in tracked):
        return None
    return frozenset().union(*(f.labels if f.pure else f.carried for _, f in tracked))


def whole_rows(args, kwargs, x, flow: Flow | None) -> bool:
    """F.layer_norm over the last dim of a pure, intact value that holds no norm's output (one read so still
    needs its bias)."""
    shape = kwargs.get("normalized_shape", args[1] if len(args) > 1 else None)
    return flow is not None and flow.pure and not flow.zero and flow.codes is None and flow.hd == -1 and \
        list(shape or ()) == [x.shape[-1]] and not any(label.kind == "norm" for label in flow.labels)
