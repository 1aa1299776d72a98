"""Kernel launch settings measured on GPUs, by architecture: benchmarks/gpu.py's tuning pass writes them.

Plain data, so that reading it imports no Triton. Shapes it does not cover use `triton_kernels`' defaults.

TUNED[arch][(mode, itemsize, block)] is a tuple of (min_rows, num_warps, per) entries, where arch is
"sm_<major><minor>" for a CUDA device ("cpu" for the Triton interpreter), mode is "fwd" (every forward,
fused residual add and pRMSNorm included) or "bwd", itemsize the storage dtype's bytes and block the
one-block row width (a power of two). `per` is rows per program in "fwd" and programs per SM in "bwd".
The entry with the largest min_rows at most the call's row count applies; below every min_rows, the
default does.
"""
from __future__ import annotations

HEAD = "TUNED: dict[str, dict[tuple[str, int, int], tuple[tuple[int, int, int], ...]]] = "
TUNED: dict[str, dict[tuple[str, int, int], tuple[tuple[int, int, int], ...]]] = {}


def render(tuned: dict) -> str:
    """The TUNED assignment above, for `tuned`, entries sorted: benchmarks/gpu.py writes it for pasting here,
    and a test holds this file's assignment to it."""
    lines = [HEAD + "{"]
    for arch in sorted(tuned):
        lines.append(f"    {arch!r}: {{")
        lines += [f"        {tuple(key)!r}: {tuple(sorted(tuple(e) for e in tuned[arch][key]))!r},"
                  for key in sorted(tuned[arch])]
        lines.append("    },")
    return (("\n".join(lines) + "\n}") if tuned else HEAD + "{}") + "\n"
