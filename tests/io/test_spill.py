"""Tensors kept in an unlinked temporary file: byte for byte back, whatever their layout, never seen in the
folder, and a full disk said in one line."""
from __future__ import annotations

import errno
import os

import pytest
import torch

from normswap.errors import NormswapError
from normswap.io.spill import PIECE, Spill


def test_tensors_come_back_exactly_and_the_file_is_never_seen(tmp_path):
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(3, PIECE // 4 + 5, generator=g)
    tensors = [torch.randn(2, 5, 7, generator=g).transpose(0, 2),   # not contiguous, small
               wide.t(),                                             # not contiguous, written a slice at a time
               torch.randn(4, 3, generator=g).to(torch.bfloat16), torch.tensor(2.5), torch.empty(3, 0)]
    with Spill(tmp_path) as spill:
        handles = [spill.put(t) for t in tensors]
        assert os.listdir(tmp_path) == []
        for t, h in zip(tensors, handles):
            with h.mapped() as (back, drop):
                assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)
                drop()   # pages given back: read from the file again
                assert torch.equal(back, t)
    assert os.listdir(tmp_path) == []


def test_a_full_disk_is_one_line(tmp_path):
    class Full:
        def seek(self, n):
            pass

        def write(self, b):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            pass
    spill = Spill(tmp_path)
    spill.file.close()
    spill.file = Full()
    with pytest.raises(NormswapError, match=r"^cannot keep tensors on disk in .*: No space left on device$"):
        spill.put(torch.ones(3))
