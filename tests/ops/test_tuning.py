"""`tuning.TUNED`, the measured launch settings: every entry is one the kernels can launch."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from normswap.ops import tuning

pytest.importorskip("triton")
from normswap.ops import triton_kernels as K  # noqa: E402


def power_of_two(n) -> bool:
    return isinstance(n, int) and n >= 1 and n & (n - 1) == 0


def test_every_tuned_entry_can_be_launched():
    for arch, by_shape in tuning.TUNED.items():
        assert re.fullmatch(r"sm_\d+|cpu", arch), arch
        for (mode, itemsize, block), entries in by_shape.items():
            where = f"{arch} {mode} {itemsize} {block}"
            assert mode in ("fwd", "bwd") and itemsize in (2, 4), where
            assert power_of_two(block) and block <= (K.MAX_BLOCK if mode == "fwd" else K.MAX_BLOCK_BWD), where
            min_rows = [e[0] for e in entries]
            assert entries and len(set(min_rows)) == len(min_rows) and min(min_rows) >= 1, where
            for _, warps, per in entries:
                assert power_of_two(warps) and warps <= 32, where
                if mode == "fwd":   # one row, or a tile of rows that does not spill
                    assert power_of_two(per) and (per == 1 or per * block <= K.MAX_TILE), where
                else:               # programs per SM
                    assert isinstance(per, int) and 1 <= per <= 64, where


def test_the_check_above_rejects_a_bad_entry(monkeypatch):
    for bad in ((1, 8, 3), (1, 8, 16), (1, 64, 1)):   # 3 rows: no tile; a tile that spills; too many warps
        monkeypatch.setattr(tuning, "TUNED", {"sm_90": {("fwd", 2, 1024): (bad,)}})
        with pytest.raises(AssertionError):
            test_every_tuned_entry_can_be_launched()


def test_the_file_holds_what_the_tuning_pass_writes():
    # benchmarks/gpu.py writes `render`'s text for pasting into tuning.py: the file must hold it verbatim.
    text = Path(tuning.__file__).read_text()
    assert tuning.render(tuning.TUNED) in text


def test_render_round_trips():
    tuned = {"sm_90": {("fwd", 2, 1024): ((16384, 8, 4), (2048, 4, 2)), ("bwd", 4, 8192): ((2048, 32, 1),)},
             "sm_100": {("fwd", 4, 512): ((1, 4, 1),)}}
    for value in (tuned, {}):
        scope = {}
        exec(tuning.render(value), scope)
        assert scope["TUNED"] == {a: {k: tuple(sorted(v)) for k, v in by.items()} for a, by in value.items()}
