"""The form torch.compile traces for a CPU norm with a gain: one autograd.Function with a written backward.

Why not autograd's backward of the decomposition: it reduces dweight over the rows as one column sum, which
Inductor's CPU code walks one vector of columns at a time down every row, a strided read of dy and h. At
sizes that spill L2 that pass was most of the backward, and it is the same pass compiled LayerNorm makes, so
RMSNorm's saving was lost there (benchmarks/RESULTS.md, "Compiled backward: dweight summed in row blocks").
Here the rows are summed in blocks of `BLOCK` first, then the block sums. Everything stays traceable, so
Inductor still fuses the norm with its neighbours (an opaque C++ backward measured slower for that reason).
Its forward is `one_pass`, the form every compiled norm takes (`rms_norm_graph`), with or without it.
"""
from __future__ import annotations

import torch
import torch.autograd.forward_ad as _fwad

# Rows per block of the dweight sum: 16 rows of dy and h per column vector stay in L1 while a block is summed.
BLOCK = 16
# Rows x width up to which an fp32 norm of a static shape sums dweight in one pass: there dy and h stay in L2,
# and the blocks' extra pass cost more than the strided walk saves (128 x 768: 0.83-0.85x compiled LayerNorm's
# backward, 0.91x blocked); above it, and in bf16 at some widths, the blocks measured faster (RESULTS.md).
PLAIN_FP32 = 2 ** 18


def applies(h: torch.Tensor, weight: torch.Tensor | None) -> bool:
    """Whether `rms_norm_graph` serves this call: a CPU tensor with a 1-D gain, outside torch.func transforms
    and forward-mode AD (an autograd.Function here defines neither a vmap rule nor a jvp)."""
    return (h.device.type == "cpu" and weight is not None and weight.dim() == 1
            and not torch._C._are_functorch_transforms_active() and _fwad._current_level < 0)


def column_sum(t: torch.Tensor, plain: bool = False) -> torch.Tensor:
    """The sum over every dim but the last: in blocks of BLOCK rows, then over the block sums and the rest;
    in one pass where `plain` or under BLOCK rows."""
    t = t.reshape(-1, t.shape[-1])
    n, d = t.shape
    if n < BLOCK or plain:
        return t.sum(0)
    q = n // BLOCK
    blocks = t[:q * BLOCK].view(q, BLOCK, d).sum(1).sum(0)
    if isinstance(n, int) and n == q * BLOCK:   # a static row count with no rest: no masked pass over none
        return blocks
    # The rest as the last BLOCK rows less those a block holds: a slice of n % BLOCK rows would make a
    # dynamic row count recompile when it is 0 (and padding instead made bf16 ~3x slower: masked loads).
    kept = torch.arange(BLOCK, device=t.device).unsqueeze(-1) >= BLOCK - (n - q * BLOCK)
    return blocks + torch.where(kept, t[n - BLOCK:], 0.0).sum(0)


def one_pass(h: torch.Tensor, weight: torch.Tensor | None, eps: float, k: int):
    """(y, r): y = h r w in fp32, returned in h's dtype, contiguous; r = (mean(h[..., :k]^2) + eps)^-1/2.
    One pass over the row, `x * rsqrt(ms + eps)`: Inductor's cheapest form."""
    hf = h.float()
    hk = hf if k == h.shape[-1] else hf[..., :k]
    rstd = torch.rsqrt(hk.pow(2).mean(-1, keepdim=True) + eps)
    y = hf * rstd
    y = y if weight is None else y * weight.float()
    return y.to(h.dtype).contiguous(), rstd   # contiguous as LayerNorm's, whatever h's strides


class _GraphRMSNorm(torch.autograd.Function):
    """`one_pass` (y, r) with the backward written out; r is not differentiable."""

    @staticmethod
    def forward(h, weight, eps, k):
        return one_pass(h, weight, eps, k)

    @staticmethod
    def setup_context(ctx, inputs, output):
        h, weight, _, k = inputs
        ctx.save_for_backward(h, weight, output[1])
        ctx.mark_non_differentiable(output[1])
        ctx.k = k

    @staticmethod
    def backward(ctx, dy, _drstd):
        # With g = dy w and c = sum_j g_j h_j (all d columns: every y_j depends on r):
        # dh = r g - r^3 (c / k) h [j < k];  dweight = sum over rows of dy h r.
        h, weight, rstd = ctx.saved_tensors
        k, d = ctx.k, h.shape[-1]
        hf, dyf = h.float(), dy.float()
        dh = dw = None
        if ctx.needs_input_grad[0]:
            g = dyf * weight.float()
            hk = hf if k == d else torch.where(torch.arange(d, device=h.device) < k, hf, 0.0)
            c = (g * hf).sum(-1, keepdim=True) * (rstd * rstd / k)
            dh = (rstd * (g - hk * c)).to(h.dtype)
        if ctx.needs_input_grad[1]:
            n = h.numel()   # an int where the shape is static, a SymInt (never plain) where it is dynamic
            plain = h.dtype == torch.float32 and isinstance(n, int) and n <= PLAIN_FP32
            dw = column_sum(dyf * hf * rstd, plain).to(weight.dtype)
        return dh, dw, None, None


def rms_norm_graph(h: torch.Tensor, weight: torch.Tensor | None, eps: float, k: int) -> torch.Tensor:
    """RMSNorm of h (rms from its first k features, gain `weight`) in h's dtype, for a graph torch.compile
    traces: the autograd.Function where it `applies`, autograd of `one_pass` elsewhere."""
    if applies(h, weight):
        return _GraphRMSNorm.apply(h, weight, eps, k)[0]
    return one_pass(h, weight, eps, k)[0]
