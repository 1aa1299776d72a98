"""Graph passes after export: onnxscript's fusion rules for what the exporter left decomposed.

Our own norms are already single nodes (see translate.py). Here the library rules add
residual Add + norm -> Skip(Simplified)LayerNormalization for target "ort", and fuse RMSNorms of
other libraries (e.g. Llama's `x * rsqrt(mean(x^2) + eps) * w`) into the target's op.
"""
from __future__ import annotations

import contextlib
from collections import Counter

import onnx

RMS_OPS = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "RMSNormalization")
LN_OPS = ("LayerNormalization", "SkipLayerNormalization")


def fuse(model, target: str) -> dict[str, int]:
    """Apply the fusions for `target` to an onnx_ir Model in place; {rule set: rewrites applied}."""
    applied: dict[str, int] = {}
    if target == "ort":
        from onnxscript.rewriter.ort_fusions.rms_normalization import fuse_rms_normalization
        from onnxscript.rewriter.ort_fusions.skip_normalization import (fuse_skip_layer_normalization,
                                                                         fuse_skip_rms_normalization)
        applied["rms_norm"] = fuse_rms_normalization(model)
        applied["skip_rms_norm"] = fuse_skip_rms_normalization(model)
        applied["skip_layer_norm"] = fuse_skip_layer_normalization(model)
    else:
        with contextlib.suppress(ImportError):  # private module: absent in some onnxscript versions
            from onnxscript.rewriter.rules.fusion._rms_normalization import fuse_rms_normalization
            applied["rms_norm"] = fuse_rms_normalization(model)
    # A Skip node takes its norm's place and also outputs the residual sum, which a node between the Add and the
    # norm (another branch reading the stream: TNT's inner/outer blocks) read: sort again (stable) for the checker.
    for graph in (model.graph, *model.functions.values()):
        graph.sort()
    return applied


def drop_trailing_empty_inputs(model) -> int:
    """Omit the empty optional inputs that end a node's input list (the fusions leave SkipLayerNormalization
    with a trailing "" for its absent bias): valid ONNX either way, but OpenVINO's CPU plug-in cannot compile
    such a node ("NullNode operation with dynamic rank"). Returns how many nodes changed."""
    import onnx_ir as ir
    changed = 0
    graphs = [model.graph, *model.functions.values()]
    for graph in graphs:
        for node in ir.traversal.RecursiveGraphIterator(graph):
            n = len(node.inputs)
            while n and node.inputs[n - 1] is None:
                n -= 1
            if n < len(node.inputs):
                node.resize_inputs(n)
                changed += 1
    return changed


def norm_nodes(model: onnx.ModelProto) -> Counter:
    """How many fused norm nodes of each kind the graph holds (functions included)."""
    nodes = list(model.graph.node) + [n for f in model.functions for n in f.node]
    return Counter(n.op_type for n in nodes if n.op_type in RMS_OPS + LN_OPS)


def decomposed_rms(model: onnx.ModelProto) -> int:
    """ReduceMean nodes fed by a Pow(., 2): an RMS/variance computed op by op, i.e. an unfused norm."""
    producers = {o: n for n in model.graph.node for o in n.output}
    count = 0
    for n in model.graph.node:
        src = producers.get(n.input[0]) if n.op_type == "ReduceMean" and n.input else None
        if src is not None and src.op_type == "Pow":
            count += 1
    return count
