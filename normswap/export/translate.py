"""Export-time lowering of RMSNorm straight to one fused ONNX node (no pattern matching needed).

During export, every full-width normswap RMSNorm (and nn.RMSNorm) calls the custom op
`normswap::rms_norm`; `translation_table(target)` tells torch.onnx how to emit it:
`SimplifiedLayerNormalization` (onnxruntime's op, registered in the ONNX domain "") or the standard
opset-23 `RMSNormalization`. Both take stash_type=1, so fp16 models square and average in fp32.
"""
from __future__ import annotations

import contextlib

import onnx.defs
import torch
from torch import nn

from normswap.folder.fixes import Fixed, fixed_call
from normswap.norms import PartialRMSNorm, RMSNorm
from normswap.ops.reference import rms_norm_reference

FLOAT_TYPES = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)"]


@torch.library.custom_op("normswap::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_reference(x, weight, eps)


@_rms_norm_op.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


def _ort_schema() -> onnx.defs.OpSchema:
    """onnxruntime's SimplifiedLayerNormalization (contrib_defs.cc), which onnx itself does not define."""
    s = onnx.defs.OpSchema
    p = s.FormalParameter
    return s("SimplifiedLayerNormalization", "", 1, doc="onnxruntime contrib op",
             inputs=[p("X", "T"), p("scale", "V")], outputs=[p("Y", "V")],
             type_constraints=[("T", FLOAT_TYPES, ""), ("V", FLOAT_TYPES, "")],
             attributes=[s.Attribute("axis", s.AttrType.INT, ""), s.Attribute("epsilon", s.AttrType.FLOAT, ""),
                         s.Attribute("stash_type", s.AttrType.INT, "")])


ORT_SCHEMA = _ort_schema()


def register_ort_schema() -> None:
    """Let onnx.checker know the op (ORT put it in the ONNX domain, so the checker would reject it)."""
    with contextlib.suppress(Exception):  # already registered
        if onnx.defs.has("SimplifiedLayerNormalization"):
            return
    onnx.defs.register_schema(ORT_SCHEMA)


def translation_table(target: str, opset: int) -> dict:
    """{custom op: onnxscript function emitting the fused node} for torch.onnx.export."""
    from onnxscript.values import Op, Opset

    if target == "onnx23":
        from onnxscript import opset23

        def emit(x, weight, eps: float):
            return opset23.RMSNormalization(x, weight, axis=-1, epsilon=eps, stash_type=1)
    else:
        sln = Op(Opset("", opset), "SimplifiedLayerNormalization", ORT_SCHEMA)

        def emit(x, weight, eps: float):
            return sln(x, weight, axis=-1, epsilon=eps, stash_type=1)
    return {torch.ops.normswap.rms_norm.default: emit}


def fusable(module: nn.Module) -> bool:
    """Norms lowered to one node: full-width RMSNorm (pRMSNorm has no fused op). Other libraries'
    RMSNorms (Llama's x * rsqrt(...)) are left to onnxscript's fusion rules (fuse.py)."""
    return isinstance(module, (RMSNorm, nn.RMSNorm)) and not isinstance(module, PartialRMSNorm)


def _forward(self, x, residual=None):
    if residual is not None:  # HF models never pass it: exported op by op
        return rms_norm_reference(x, self.weight, self.eps, residual=residual)
    eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps  # nn.RMSNorm's default
    # Both fused ops need a scale input; a norm without one gets a constant of ones.
    weight = self.weight if self.weight is not None else torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    return torch.ops.normswap.rms_norm(x, weight, float(eps))


def _lowered(m: nn.Module):
    """`_forward` as the norm's forward, between its fixes where it has any (an output centred, a bias after it)."""
    if not isinstance(m, Fixed):
        return _forward.__get__(m)
    return lambda *args, **kwargs: fixed_call(m, _forward, args, kwargs)


@contextlib.contextmanager
def lowered_norms(model: nn.Module):
    """Within the block, fusable norms call `normswap::rms_norm`; their own forward is restored after."""
    patched = [(m, m.__dict__.get("forward")) for m in model.modules() if fusable(m)]
    for m, _ in patched:
        m.forward = _lowered(m)
    try:
        yield len(patched)
    finally:
        for m, own in patched:
            if own is None:
                del m.forward
            else:  # an instance-level forward someone else set (e.g. a hook wrapper)
                m.forward = own
