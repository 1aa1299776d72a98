"""Triton RMSNorm kernels: forward (optionally fused with a residual add), backward, pRMSNorm.

Only the launchers below are meant to be called; `normswap.ops.autograd` wraps them in custom ops.
All math is in fp32 whatever the storage dtype: fp16 squares overflow for |x| > 256.
Import this module only after TRITON_INTERPRET is settled: `triton.jit` reads it at decoration time.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from normswap.ops import tuning

# Widest row held in registers as one block; wider rows loop over column blocks of this size.
# The backward keeps w and the dweight partial live across rows as well, so its one-block limit is lower:
# ptxas (sm_90, bf16, no GPU needed) reports spills for a 16K-wide backward block at 16 or 32 warps and
# none at 8K. Tests shrink MAX_BLOCK to exercise the looping path on small, interpreter-friendly widths.
MAX_BLOCK = 16384
MAX_BLOCK_BWD = 8192
# Largest forward tile of several rows (rows x block elements): at 16384, ptxas (sm_90, 32 warps) spills.
MAX_TILE = 8192
# Backward programs per SM, by default: each program walks a contiguous run of rows and keeps a private
# dweight partial, so the dweight reduction costs programs x D fp32 and stays deterministic (no atomics).
# Measured settings, where a GPU run made them, are in `tuning.TUNED`.
BWD_PROGRAMS_PER_SM = 2

# `triton.jit` chose interpreted or compiled kernels when this module was imported; remember which.
INTERPRETED = bool(triton.knobs.runtime.interpret)


@triton.jit
def _pow2_scale(m):
    """The power of two just below m (mantissa bits cleared), at least 1: rows are divided by it before
    squaring, so fp32 squares cannot overflow (|x| > ~1.8e19); exact, so unscaled rows are unchanged."""
    bits = m.to(tl.int32, bitcast=True) & 0x7F800000
    return tl.maximum(bits.to(tl.float32, bitcast=True), 1.0)


@triton.jit
def _load_h(X, R, H, cols, mask, HAS_RES: tl.constexpr, STORE_H: tl.constexpr):
    """h = x (+ residual) in fp32; with a residual, h is rounded to storage precision (and stored to H
    when STORE_H) so that forward and backward, which reloads h, normalise the same values."""
    h = tl.load(X + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        h += tl.load(R + cols, mask=mask, other=0.0).to(tl.float32)
        h_out = h.to(H.dtype.element_ty)
        if STORE_H:
            tl.store(H + cols, h_out, mask=mask)
        h = h_out.to(tl.float32)
    return h


@triton.jit
def _store_y(Y, W, cols, mask, wmask, h, rstd, HAS_W: tl.constexpr):
    y = h * rstd
    if HAS_W:
        y *= tl.load(W + cols, mask=wmask, other=0.0).to(tl.float32)
    tl.store(Y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_fwd_kernel(X, R, Y, H, W, RSTD,
                         stride_x, stride_r, stride_y, stride_h,
                         n_rows, n_cols, k_cols, eps,
                         HAS_RES: tl.constexpr, HAS_W: tl.constexpr,
                         BLOCK: tl.constexpr, SINGLE: tl.constexpr, ROWS: tl.constexpr):
    if SINGLE:
        # A ROWS x BLOCK tile per program: narrow rows then keep more bytes in flight per program, and w is
        # loaded once per ROWS rows. int64 row offsets so N * D beyond 2**31 elements cannot wrap.
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        r2 = rows[:, None]
        cols = tl.arange(0, BLOCK)[None, :]
        cmask = cols < n_cols
        if ROWS == 1:   # the grid has one program per row: no row past the end (and 8 registers saved)
            mask = cmask
        else:
            mask = (r2 < n_rows) & cmask
        X += r2 * stride_x
        Y += r2 * stride_y
        if HAS_RES:
            R += r2 * stride_r
            H += r2 * stride_h
        h = _load_h(X, R, H, cols, mask, HAS_RES, True)
        hk = tl.where(cols < k_cols, h, 0.0)
        inv = 1.0 / _pow2_scale(tl.max(tl.abs(hk), axis=1))
        hk = hk * inv[:, None]
        rstd = tl.rsqrt(tl.sum(hk * hk, axis=1) / k_cols + eps * inv * inv) * inv
        _store_y(Y, W, cols, mask, cmask, h, rstd[:, None], HAS_W)
        tl.store(RSTD + rows, rstd, mask=rows < n_rows)
    else:
        # One program per row (ROWS is 1).
        row = tl.program_id(0).to(tl.int64)
        X += row * stride_x
        Y += row * stride_y
        if HAS_RES:
            R += row * stride_r
            H += row * stride_h
        # Pass 1 reads only the first k columns: that is where pRMSNorm saves bandwidth.
        # Squares of h / s, with s (a power of two) raised block by block and acc rescaled to match.
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        s = tl.full([], 1.0, tl.float32)
        for start in range(0, k_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < k_cols
            h = _load_h(X, R, H, cols, mask, HAS_RES, False)
            s_new = tl.maximum(s, _pow2_scale(tl.max(tl.abs(h), axis=0)))
            ratio = s / s_new
            hs = h * (1.0 / s_new)
            acc = acc * (ratio * ratio) + hs * hs
            s = s_new
        inv = 1.0 / s
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / k_cols + eps * inv * inv) * inv
        # Pass 2 recomputes h rather than reading back pass 1's stores: no cross-thread ordering to trust.
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < n_cols
            h = _load_h(X, R, H, cols, mask, HAS_RES, True)
            _store_y(Y, W, cols, mask, mask, h, rstd, HAS_W)
        tl.store(RSTD + row, rstd)


@triton.jit
def _rms_norm_bwd_kernel(DY, H, W, RSTD, DHO, DX, DW_PART,
                         stride_dy, stride_h, stride_dho, stride_dx,
                         n_rows, n_cols, k_cols, rows_per_prog,
                         HAS_W: tl.constexpr, HAS_DW: tl.constexpr, HAS_DHO: tl.constexpr,
                         BLOCK: tl.constexpr, SINGLE: tl.constexpr):
    # y = h * r * w with r = (mean(h[:k]^2) + eps)^-1/2. With g = dy * w and c = sum_j g_j h_j r (all D
    # columns: every y_j depends on r), dh = r * (g - (c / k) * h r * [j < k]);  dw = sum_rows dy * h r.
    pid = tl.program_id(0)
    row_start = pid * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, n_rows)
    part = DW_PART + pid.to(tl.int64) * n_cols
    # Walk the rows by advancing pointers (int64 start offset, then one stride per row).
    start64 = row_start.to(tl.int64)
    DY += start64 * stride_dy
    H += start64 * stride_h
    DX += start64 * stride_dx
    RSTD += start64
    if HAS_DHO:
        DHO += start64 * stride_dho
    if SINGLE:
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        if HAS_W:
            w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_DW:
            dw = tl.zeros([BLOCK], dtype=tl.float32)
        for _ in range(row_start, row_end):
            dy = tl.load(DY + cols, mask=mask, other=0.0).to(tl.float32)
            h = tl.load(H + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD)
            g = dy * w if HAS_W else dy
            hr = h * rstd   # = h / rms: O(1), so no product below can over- or underflow for large |h|
            c = tl.sum(g * hr, axis=0)
            dh = rstd * (g - (c / k_cols) * tl.where(cols < k_cols, hr, 0.0))
            if HAS_DHO:
                # Fused residual: h also left the forward, so its own gradient joins here.
                dh += tl.load(DHO + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(DX + cols, dh.to(DX.dtype.element_ty), mask=mask)
            if HAS_DW:
                dw += dy * hr
            DY += stride_dy
            H += stride_h
            DX += stride_dx
            RSTD += 1
            if HAS_DHO:
                DHO += stride_dho
        if HAS_DW:
            # Every program stores its row, zeros included when it got no rows: `part` needs no memset.
            tl.store(part + cols, dw, mask=mask)
    else:
        for _ in range(row_start, row_end):
            rstd = tl.load(RSTD)
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = cols < n_cols
                dy = tl.load(DY + cols, mask=mask, other=0.0).to(tl.float32)
                h = tl.load(H + cols, mask=mask, other=0.0).to(tl.float32)
                if HAS_W:
                    dy *= tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
                acc += dy * (h * rstd)
            coef = tl.sum(acc, axis=0) / k_cols
            for start in range(0, n_cols, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = cols < n_cols
                dy = tl.load(DY + cols, mask=mask, other=0.0).to(tl.float32)
                h = tl.load(H + cols, mask=mask, other=0.0).to(tl.float32)
                if HAS_W:
                    g = dy * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
                else:
                    g = dy
                hr = h * rstd
                dh = rstd * (g - coef * tl.where(cols < k_cols, hr, 0.0))
                if HAS_DHO:
                    dh += tl.load(DHO + cols, mask=mask, other=0.0).to(tl.float32)
                tl.store(DX + cols, dh.to(DX.dtype.element_ty), mask=mask)
                if HAS_DW:
                    # The partial row is private to this program and each element is loaded and stored
                    # through the same pointer layout, so the read-modify-write needs no atomics.
                    acc_w = tl.load(part + cols, mask=mask, other=0.0)
                    tl.store(part + cols, acc_w + dy * hr, mask=mask)
            DY += stride_dy
            H += stride_h
            DX += stride_dx
            RSTD += 1
            if HAS_DHO:
                DHO += stride_dho


def _block(n_cols: int, limit: int) -> tuple[int, bool]:
    """(block width, whether one block covers the row)."""
    block = triton.next_power_of_2(n_cols)
    return (block, True) if block <= limit else (triton.next_power_of_2(limit), False)


def _num_warps(block: int, per_warp: int) -> int:
    # Sized so ptxas stays near 64 registers/thread forward and <= 128 backward at sm_90 (checked offline
    # with ptxas -v); the defaults where `tuning.TUNED` has no measured setting.
    return max(4, min(32, block // per_warp))


class FwdLaunch(NamedTuple):
    num_warps: int
    rows_per_program: int = 1   # one-block rows only: a rows x block tile per program


class BwdLaunch(NamedTuple):
    num_warps: int
    programs_per_sm: int = BWD_PROGRAMS_PER_SM


@functools.cache   # on every launch without a measured setting: a lookup, not a new tuple (~0.3 us)
def default_launch(mode: str, block: int) -> FwdLaunch | BwdLaunch:
    return FwdLaunch(_num_warps(block, 512)) if mode == "fwd" else BwdLaunch(_num_warps(block, 256))


@functools.lru_cache(maxsize=None)
def _arch(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def launch_for(mode: str, device: torch.device, n_rows: int, itemsize: int, block: int,
               single: bool) -> FwdLaunch | BwdLaunch:
    """The measured setting for this shape on this device's architecture (`tuning.TUNED`), else the default."""
    by_shape = tuning.TUNED.get(_arch(device)) if single else None
    if by_shape:
        best = None
        for min_rows, warps, per in by_shape.get((mode, itemsize, block), ()):
            if min_rows <= n_rows and (best is None or min_rows > best[0]):
                best = (min_rows, warps, per)
        if best is not None:
            return (FwdLaunch if mode == "fwd" else BwdLaunch)(best[1], best[2])
    return default_launch(mode, block)


def _rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """A 2-D (rows, n_cols) view with unit column stride; copies only when no such view exists."""
    t = t.reshape(-1, n_cols)
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_device(x: torch.Tensor) -> None:
    if x.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError("the Triton RMSNorm backend got CPU tensors: run on CUDA, set TRITON_INTERPRET=1 "
                           "(before normswap's kernels are first used), or set NORMSWAP_BACKEND=torch")


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor | None, eps: float, k: int,
                 residual: torch.Tensor | None = None, max_block: int | None = None,
                 launch: FwdLaunch | None = None):
    """Returns (y, h, rstd): y and h shaped like x (h is None without `residual`), rstd fp32 per row.
    `launch` overrides the measured or default setting (benchmarks/gpu.py's tuning pass, tests)."""
    _check_device(x)
    d = x.shape[-1]
    x2 = _rows(x, d)
    n = x2.shape[0]
    y = torch.empty((n, d), dtype=x.dtype, device=x.device)
    rstd = torch.empty(n, dtype=torch.float32, device=x.device)
    if residual is not None:
        r2 = _rows(residual, d)
        h = torch.empty((n, d), dtype=x.dtype, device=x.device)
    else:
        r2 = h = None
    if weight is not None:
        weight = weight.contiguous()
    if n > 0:
        block, single = _block(d, MAX_BLOCK if max_block is None else max_block)
        launch = launch or launch_for("fwd", x.device, n, x.element_size(), block, single)
        rows = launch.rows_per_program if single else 1
        _rms_norm_fwd_kernel[(triton.cdiv(n, rows),)](
            x2, r2, y, h, weight, rstd,
            x2.stride(0), r2.stride(0) if r2 is not None else 0, y.stride(0), h.stride(0) if h is not None else 0,
            n, d, k, float(eps),
            HAS_RES=residual is not None, HAS_W=weight is not None, BLOCK=block, SINGLE=single, ROWS=rows,
            num_warps=launch.num_warps)
    shape = x.shape
    return y.view(shape), (h.view(shape) if h is not None else None), rstd.view(shape[:-1])


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_programs(device: torch.device, n_rows: int, per_sm: int) -> int:
    if device.type == "cuda":
        sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    else:
        sms = 2   # the interpreter runs programs one by one: few, but more than one
    return max(1, min(n_rows, sms * per_sm))


def rms_norm_bwd(dy: torch.Tensor, h: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor | None, k: int,
                 dh_out: torch.Tensor | None = None, need_dw: bool = True, max_block: int | None = None,
                 launch: BwdLaunch | None = None):
    """Returns (dx, dw): dx shaped like h in h's dtype; dw in weight's dtype, or None without weight/need_dw.

    `dh_out` is the gradient flowing into the returned h of the fused residual path; it is added into dx,
    which is then the gradient of both x and residual.
    """
    _check_device(h)
    d = h.shape[-1]
    h2, dy2 = _rows(h, d), _rows(dy, d)
    dho2 = _rows(dh_out, d) if dh_out is not None else None
    n = h2.shape[0]
    rstd = rstd.reshape(-1).contiguous()
    dx = torch.empty((n, d), dtype=h.dtype, device=h.device)
    has_w = weight is not None
    has_dw = has_w and need_dw
    if has_w:
        weight = weight.contiguous()
    block, single = _block(d, min(MAX_BLOCK, MAX_BLOCK_BWD) if max_block is None else max_block)
    launch = launch or launch_for("bwd", h.device, n, h.element_size(), block, single)
    progs = _num_programs(h.device, n, launch.programs_per_sm)
    # dweight partials, one fp32 row per program; the looping path accumulates into its row, so zero it.
    alloc = torch.empty if single else torch.zeros
    part = alloc((progs, d) if has_dw else (1, 1), dtype=torch.float32, device=h.device)
    if n > 0:
        _rms_norm_bwd_kernel[(progs,)](
            dy2, h2, weight, rstd, dho2, dx, part,
            dy2.stride(0), h2.stride(0), dho2.stride(0) if dho2 is not None else 0, dx.stride(0),
            n, d, k, triton.cdiv(n, progs),
            HAS_W=has_w, HAS_DW=has_dw, HAS_DHO=dh_out is not None, BLOCK=block, SINGLE=single,
            num_warps=launch.num_warps)
    if has_dw and n == 0:
        part.zero_()
    dw = part.sum(0).to(weight.dtype) if has_dw else None  # fixed-order sum: deterministic
    return dx.view(h.shape), dw
