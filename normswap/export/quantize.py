"""int8 quantization of a validated fp32 export, and its validation against the PyTorch model.

onnxruntime's `quantize_dynamic` on MatMul and Gemm only: weights int8 per output channel with 7-bit range
(reduce_range: ORT's advice for per-channel weights on CPUs without VNNI, where the u8 x s8 kernels saturate;
measured: full-range per-channel int8 gave 5-15x the logit error of 7-bit on an AVX2 EPYC), activations uint8
per tensor, quantized at run time (DynamicQuantizeLinear + MatMulInteger, what ORT's CPU provider runs fast).
Norms, embeddings (Gather) and the attention's activation-by-activation MatMuls stay fp32, and so does an online
rotation's MatMul by its small factor (`rotate --online`: part of the rotation that makes the next input
quantizable, which a rounding of its own would undo in part); the fused norm nodes must be all there after
quantization, in the file and in ORT's optimised graph, or it is refused.

An int8 model is not exact, so its error is measured, not bounded: on the validation inputs (`validate.SIZES`,
or the example batches of a module) against PyTorch in fp32, the max relative error of the main output (max |Δ|
over max |reference|), and for logits the KL divergence of the next-token distributions and top-1 agreement. It
is refused only where it is broken: a NaN/inf output, top-1 agreement below MIN_TOP1 (logits), or a max
relative error above MAX_REL (other outputs).
"""
from __future__ import annotations

import contextlib
import logging
import os
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn

from normswap.errors import NormswapError, first_line
from normswap.export import fuse, validate
from normswap.folder.portable import ONLINE

OPS = ("MatMul", "Gemm")   # what is quantized
MIN_TOP1 = 0.5   # logits: refused below this top-1 agreement with PyTorch fp32 (a working int8 LM is > 0.9)
MAX_REL = 0.5    # other outputs: refused above this max |Δ| / max |reference|
WEIGHTS = "int8 per output channel, 7-bit range (MatMul, Gemm)"
ACTIVATIONS = "uint8 per tensor, quantized at run time"


@contextlib.contextmanager
def _quiet():
    """quantize_dynamic logs advice (pre-processing) on the root logger: not for our users' stderr."""
    before = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(before)


def _files(path: Path) -> list[Path]:
    return [p for p in (path, path.with_name(path.name + ".data")) if p.exists()]


def online_factors(graph: onnx.GraphProto) -> list[str]:
    """The MatMul nodes multiplying by an online rotation's factor (a `portable.ONLINE` parameter), by node name."""
    factors = {i.name for i in graph.initializer if i.name.endswith(ONLINE[1])}
    return [n.name for n in graph.node if n.op_type in OPS and factors & set(n.input)]


def _quantize_file(src: Path, dst: Path, external_data: bool) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic
    kept = online_factors(onnx.load(str(src), load_external_data=False).graph)
    try:
        with _quiet():
            quantize_dynamic(src, dst, op_types_to_quantize=list(OPS), per_channel=True, reduce_range=True,
                             weight_type=QuantType.QInt8, use_external_data_format=external_data,
                             nodes_to_exclude=kept)
    except Exception as e:
        raise NormswapError(f"onnxruntime's quantize_dynamic failed: {first_line(e)[:300]}") from None


def _check_graph(src: Path, dst: Path, report) -> dict[str, int]:
    """The quantized graph's integer ops; refused unless it has some and keeps every fused norm node."""
    before = fuse.norm_nodes(onnx.load(str(src), load_external_data=False))
    graph = onnx.load(str(dst), load_external_data=False)
    after = fuse.norm_nodes(graph)
    ops = Counter(n.op_type for n in graph.graph.node)
    if not ops["MatMulInteger"]:
        raise NormswapError("nothing to quantize: the graph has no MatMul or Gemm with constant weights")
    optimised = validate.optimized_norm_nodes(dst)
    if after != before or optimised != report.fused:
        raise NormswapError(f"quantization changed the fused norm nodes: {dict(before)} before, {dict(after)} "
                            f"after ({optimised} once ORT optimised it)")
    return {k: ops[k] for k in ("MatMulInteger", "DynamicQuantizeLinear", "MatMul", "Gemm") if ops[k]}


def _logits_rows(sess, reference: nn.Module, report) -> list[dict]:
    """Per validation size: max relative error, KL(PyTorch || int8) per position, top-1 agreement."""
    rows = []
    for batch, seq, got, ref, keep in validate.outputs(sess, reference, report.output, report.with_past,
                                                       np.float32):
        g, r = torch.from_numpy(got[keep]), torch.from_numpy(ref[keep])
        row = {"batch": batch, "seq": seq, "positions": int(keep.sum()), "finite": bool(torch.isfinite(g).all()),
               "max_rel": float((g - r).abs().max() / r.abs().max().clamp_min(1e-30))}
        if report.output == "logits":
            p, q = r.log_softmax(-1), g.log_softmax(-1)
            row["kl"] = float((p.exp() * (p - q)).sum(-1).mean())
            row["top1"] = float((g.argmax(-1) == r.argmax(-1)).double().mean())
        rows.append(row)
    return rows


def _module_rows(sess, reference: nn.Module, batches: list[dict], names: list[str]) -> list[dict]:
    """Per example batch and output: max relative error of the int8 graph against PyTorch."""
    rows = []
    for i, batch in enumerate(batches):
        for r in validate.module_parity(sess, reference, batch, names, f"example batch {i}", np.float32):
            rows.append({"inputs": r["inputs"], "output": r["output"], "finite": r["finite"],
                         "max_rel": r["max_abs"] / max(r["ref_max"], 1e-30)})
    return rows


def _summary(rows: list[dict]) -> dict:
    out = {"max_rel": max(r["max_rel"] for r in rows), "finite": all(r["finite"] for r in rows)}
    if "top1" in rows[0]:
        n = sum(r["positions"] for r in rows)
        out.update(positions=n, kl=sum(r["kl"] * r["positions"] for r in rows) / n,
                   top1=sum(r["top1"] * r["positions"] for r in rows) / n)
    return out


def _refuse_broken(s: dict) -> None:
    if not s["finite"]:
        raise NormswapError("the int8 model is broken: it gives NaN/inf where the fp32 model does not")
    if "top1" in s and s["top1"] < MIN_TOP1:
        raise NormswapError(f"the int8 model is broken: its top-1 token agrees with the fp32 model's at "
                            f"{s['top1']:.0%} of positions (< {MIN_TOP1:.0%}; KL {s['kl']:.3g})")
    if "top1" not in s and s["max_rel"] > MAX_REL:
        raise NormswapError(f"the int8 model is broken: max relative error {s['max_rel']:.3g} > {MAX_REL}")


def quantize(staged: Path, report, reference: nn.Module, batches: list[dict] | None = None,
             names: list[str] | None = None) -> dict:
    """Replace the validated fp32 export `staged` (and its external data) by its int8 quantization, measured
    against `reference` (fp32 PyTorch) on the validation inputs (`batches` and output `names`: a module exported
    on example inputs); what it measured, for `report.quantized`. Raises NormswapError, `staged` left as it
    was, where quantization fails, loses a fused norm or gives a broken model (see the module docstring)."""
    work = staged.parent / "int8"
    work.mkdir()
    dst = work / staged.name
    _quantize_file(staged, dst, report.external_data)
    ops = _check_graph(staged, dst, report)
    try:
        sess = validate.session(dst)
    except Exception as e:
        raise NormswapError(f"onnxruntime cannot load the int8 model: {first_line(e)[:300]}") from None
    rows = _module_rows(sess, reference, batches, names) if batches is not None else \
        _logits_rows(sess, reference, report)
    summary = _summary(rows)
    _refuse_broken(summary)
    threshold = {"refused_below_top1": MIN_TOP1} if "top1" in summary else {"refused_above_max_rel": MAX_REL}
    out = {"scheme": "int8", "weights": WEIGHTS, "activations": ACTIVATIONS, "ops": ops, **summary, **threshold,
           "rows": rows, "bytes": {"fp32": sum(p.stat().st_size for p in _files(staged)),
                                   "int8": sum(p.stat().st_size for p in _files(dst))}}
    if batches is None:
        out["latency_ms"] = validate.latency_ms(sess, reference, report.with_past, np.float32)
    del sess
    for p in _files(staged):
        p.unlink()
    for p in _files(dst):
        os.replace(p, staged.parent / p.name)
    work.rmdir()
    return out
