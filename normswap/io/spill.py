"""Tensors kept on disk instead of in memory, mapped back while they are read: a lazy conversion's verification keeps
the original model's outputs this way (a 512-token row's logits and cache: 0.2 GB on GPT-2-medium), so the
converted model runs with none of them resident.

The file is unlinked from the start (`tempfile.TemporaryFile`): it never shows in its folder and is gone when
closed, or when the process dies. Its pages are the page cache's, not the process's, until a tensor is mapped
back, and only as they are read (`Spilled.mapped`).
"""
from __future__ import annotations

import mmap
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from normswap.errors import NormswapError

PIECE = 1 << 20   # bytes written at a time from a tensor that is not contiguous


class Spill:
    """An unlinked temporary file in `folder` that tensors are appended to (`put`), exactly, byte for byte."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        try:
            self.file = tempfile.TemporaryFile(dir=self.folder)
        except OSError as e:
            raise self.failed(e) from None
        self.size = 0

    def failed(self, e: OSError) -> NormswapError:
        return NormswapError(f"cannot keep tensors on disk in {self.folder}: {e.strerror or e}")

    def put(self, t: torch.Tensor) -> Spilled:
        """Write `t`'s values (page-aligned, so that each maps back on its own); the handle to read them."""
        t = t.detach()
        start = -(-self.size // mmap.ALLOCATIONGRANULARITY) * mmap.ALLOCATIONGRANULARITY
        try:
            self.file.seek(start)
            _write(self.file, t)
            self.file.flush()
        except OSError as e:   # a full disk: one line, not a traceback
            raise self.failed(e) from None
        self.size = start + t.numel() * t.element_size()
        return Spilled(self, start, t.dtype, tuple(t.shape))

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> Spill:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _write(f, t: torch.Tensor) -> None:
    """t's values in row-major order; a tensor that is not contiguous ~PIECE bytes at a time."""
    if not t.numel():
        return
    if t.is_contiguous() or t.dim() <= 1 or t.numel() * t.element_size() <= PIECE:
        f.write(t.contiguous().reshape(-1).cpu().view(torch.uint8).numpy())
        return
    row = t[0].numel() * t.element_size()
    for x in (t.unbind(0) if row >= PIECE else t.split(PIECE // row)):
        _write(f, x)


@dataclass(frozen=True)
class Spilled:
    """A tensor written to a `Spill`: its place, dtype and shape."""
    spill: Spill
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @contextmanager
    def mapped(self):
        """(its values, drop): the values mapped copy-on-write from the file, resident only as they are read
        (writes stay private); `drop()` gives back the pages read so far, which are read from the file again
        if used again. The mapping lives as long as the tensor."""
        n = torch.Size(self.shape).numel()
        if not n:
            yield torch.empty(self.shape, dtype=self.dtype), _nothing
            return
        buf = mmap.mmap(self.spill.file.fileno(), n * self.dtype.itemsize, access=mmap.ACCESS_COPY,
                        offset=self.offset)
        yield torch.frombuffer(buf, dtype=self.dtype, count=n).reshape(self.shape), \
            lambda: buf.madvise(mmap.MADV_DONTNEED)


def _nothing() -> None:
    pass
