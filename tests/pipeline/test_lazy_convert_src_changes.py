"""Issue 33 (18): SRC's weights files rewritten or replaced while a lazy convert reads them: refused,
nothing written (an OUT mixing old and new tensors would pass as a conversion of either)."""
from __future__ import annotations

import os

import pytest

from normswap.errors import NormswapError
from normswap.pipeline import lazy_convert

from helpers.tiny import tiny_model


def _rewrite_in_place(shard):
    with open(shard, "r+b") as f:   # the last byte of tensor data, changed where it lies
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))


def _replace_by_rename(shard):
    copy = shard.with_name("copy")
    copy.write_bytes(shard.read_bytes())
    os.replace(copy, shard)


@pytest.mark.parametrize("change", [_rewrite_in_place, _replace_by_rename])
def test_src_changed_during_a_lazy_convert_writes_nothing(tmp_path, monkeypatch, change):
    src = tmp_path / "src"
    tiny_model("gpt2").save_pretrained(src, max_shard_size="50kB")
    shard = sorted(src.glob("*.safetensors"))[-1]
    real = lazy_convert.verify_lazy

    def changed_meanwhile(*args, **kw):   # SRC changes after its tensors were copied into OUT
        change(shard)
        return real(*args, **kw)
    monkeypatch.setattr(lazy_convert, "verify_lazy", changed_meanwhile)
    with pytest.raises(NormswapError, match=rf"{shard.name} changed while it was read \(rewritten or replaced\): "
                                            "nothing written"):
        lazy_convert.convert_folder(src, tmp_path / "out", method="naive")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
