"""Before writing, the free space is checked: a shortfall is said in fitting units, and a read-only file
system is called read-only, not full; nothing is written either way (issue 20)."""
from __future__ import annotations

import os
import shutil
from collections import namedtuple

import pytest

from normswap.io import safetensors
from normswap.errors import NormswapError

Usage = namedtuple("Usage", "total used free")
Stat = namedtuple("Stat", "f_flag")


def test_space_is_said_in_fitting_units(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**6, 10**6 - 900, 900))
    with pytest.raises(NormswapError, match=r"the weights need 5.3 MB, 900 bytes are free; nothing was written"):
        safetensors.check_space(tmp_path / "m", 5_300_000)
    safetensors.check_space(tmp_path / "m", 900)


def test_read_only_file_system_is_not_called_full(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**9, 10**9, 0))   # what such mounts report
    monkeypatch.setattr(os, "statvfs", lambda path: Stat(os.ST_RDONLY))
    with pytest.raises(NormswapError, match="is on a read-only file system; nothing was written"):
        safetensors.check_space(tmp_path / "m", 1000)
