"""RMSNorm and pRMSNorm modules (Zhang & Sennrich, 2019): thin wrappers over `normswap.ops.rms_norm`."""
from __future__ import annotations

import torch
from torch import nn

from normswap import ops
from normswap.errors import Choice


class NormType(Choice):
    """What a LayerNorm becomes (`convert(to=...)`, a saved norm's "type"): RMSNorm, or pRMSNorm (the RMS
    estimated from the first features)."""

    RMSNORM = "rmsnorm"
    PRMSNORM = "prmsnorm"


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dimension, computed in fp32.

    eps must be positive and finite; integer inputs are refused (TypeError), not truncated."""

    def __init__(self, normalized_shape: int, eps: float = 1e-6, elementwise_affine: bool = True,
                 device=None, dtype=None):
        super().__init__()
        self.normalized_shape = _width(normalized_shape)
        self.eps = ops.check_eps(eps)   # eps <= 0 would give NaN on an all-zero row
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    @property
    def p(self) -> float | None:
        return None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Normalise x; with `residual`, normalise x + residual and return (y, x + residual)."""
        return ops.rms_norm(x, self.weight, self.eps, residual=residual, p=self.p)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class PartialRMSNorm(RMSNorm):
    """pRMSNorm: the RMS is estimated from the first ceil(p * d) features (paper, section 4)."""

    def __init__(self, normalized_shape: int, p: float = 0.0625, eps: float = 1e-6,
                 elementwise_affine: bool = True, device=None, dtype=None):
        ops.partial_width(_width(normalized_shape), p)  # validates p
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        self._p = float(p)

    @property
    def p(self) -> float:
        return self._p

    def extra_repr(self) -> str:
        return super().extra_repr() + f", p={self._p}"


def _width(normalized_shape) -> int:
    """The normalised width: a positive int, or a sequence of one (as nn.LayerNorm / nn.RMSNorm take it)."""
    shape = normalized_shape
    if isinstance(shape, (tuple, list, torch.Size)) and len(shape) == 1:
        shape = shape[0]
    if isinstance(shape, bool) or not isinstance(shape, int) or shape < 1:
        raise ValueError(f"normalized_shape must be a positive int (the last dimension), got {normalized_shape!r}")
    return int(shape)


def norm_spec(module: RMSNorm) -> dict:
    """What rebuilds `module` (recorded in config.normswap, read back by `build_norm`)."""
    return {"type": (NormType.PRMSNORM if isinstance(module, PartialRMSNorm) else NormType.RMSNORM).value,
            "width": module.normalized_shape, "eps": module.eps, "p": module.p,
            "affine": module.elementwise_affine}


def build_norm(spec: dict, like: nn.Module) -> RMSNorm:
    """A fresh norm from a `norm_spec`, on the device and in the dtype of `like`'s weight (if any)."""
    ref = getattr(like, "weight", None)
    kw = dict(eps=spec["eps"], elementwise_affine=spec["affine"],
              **(dict(device=ref.device, dtype=ref.dtype) if ref is not None else {}))
    if spec["type"] == NormType.PRMSNORM:
        return PartialRMSNorm(spec["width"], p=spec["p"], **kw)
    return RMSNorm(spec["width"], **kw)


def off_fast_path(model: nn.Module) -> list[str]:
    """Keep torch's fused encoder path off wherever a TransformerEncoderLayer's norm is no longer a LayerNorm;
    the names of the layers it is off for (idempotent).

    In eval, nn.TransformerEncoderLayer runs torch._transformer_encoder_layer_fwd, which computes LayerNorm
    from norm1's and norm2's weight and bias, and nn.TransformerEncoder packs padded batches into nested
    tensors for it. torch's own check skips that path when `activation_relu_or_gelu` is 0 (a flag read only
    there: the activation applied is `activation`), so the layer runs its Python forward, which calls its
    norms; `use_nested_tensor` False is what the encoder's constructor sets when the path is unavailable.
    Not saved in a state_dict: a rebuilt model needs this call again."""
    off = {name: m for name, m in model.named_modules() if isinstance(m, nn.TransformerEncoderLayer)
           and not all(isinstance(n, nn.LayerNorm) for n in (m.norm1, m.norm2))}
    for layer in off.values():
        layer.activation_relu_or_gelu = 0
    for m in model.modules():
        if isinstance(m, nn.TransformerEncoder) and any(layer in off.values() for layer in m.layers):
            m.use_nested_tensor = False
    return list(off)


def fast_path_flags(model: nn.Module) -> list[tuple[nn.Module, str, object]]:
    """(module, attribute, value) of every flag `off_fast_path` may change, to put back as they were."""
    return [(m, a, getattr(m, a)) for m in model.modules() for a in ("activation_relu_or_gelu", "use_nested_tensor")
            if isinstance(m, (nn.TransformerEncoderLayer, nn.TransformerEncoder)) and hasattr(m, a)]
