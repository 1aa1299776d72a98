"""Issue 20: leftovers of killed runs are recovered, and only those: a user's look-alike folders beside OUT
are never deleted or renamed; long OUT names work; an OUT where SRC's symlinks point is refused."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

import normswap
from normswap.cli import main
from normswap.errors import NormswapError

from helpers.cli import snapshot
from helpers.export_models import converted as naive_conversion

KILLED = textwrap.dedent("""
    import os, sys, types
    from pathlib import Path
    pkg = sys.modules["normswap"] = types.ModuleType("normswap")  # atomic.py alone: no torch import
    pkg.__path__ = [sys.argv[3]]
    from normswap.io import rename
    from normswap.io.atomic import atomic_dir
    out, when, real, exchange = Path(sys.argv[1]), sys.argv[2], os.rename, rename.exchange

    def moved(a, b):   # killed outright right after moving the old OUT aside (no exchange on this system)
        real(a, b)
        if when == "swap" and Path(a) == out:
            os._exit(9)

    def exchanged(a, b):   # killed outright right after exchanging the old OUT with the new one
        assert exchange(a, b)
        os._exit(9)
    os.rename = moved
    rename.exchange = exchanged if when == "exchange" else lambda a, b: False
    with atomic_dir(out, overwrite=True) as tmp:
        (tmp / "config.json").write_text('{"normswap": {"who": "killed"}}')
        if when == "writing":
            os._exit(9)
""")


@pytest.fixture(scope="module")
def converted():
    return naive_conversion("gpt2")


def kill_during(out, when):
    done = subprocess.run([sys.executable, "-c", KILLED, str(out), when, os.path.dirname(normswap.__file__)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 9, done.stderr


def user_folders(parent, name):
    """Folders a user keeps beside OUT, named like normswap's leftovers (two of them exactly so)."""
    made = {}
    for suffix in ("old-mybackup", "tmp-notes", "old-4242", "tmp-4242-deadbeef"):
        folder = parent / f".{name}.{suffix}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"normswap": {"mine": suffix}}))
        made[folder.name] = snapshot(folder)
    return made


@pytest.mark.parametrize("out_exists", [True, False])
def test_users_look_alike_folders_are_never_touched(tmp_path, converted, out_exists):
    out = tmp_path / "m"
    if out_exists:
        normswap.save_pretrained(converted, out)
    mine = user_folders(tmp_path, "m")
    (tmp_path / ".m.lock").write_text("4242\nold .m.old-mybackup\nold .m.old-77\n")  # a forged journal line too
    normswap.save_pretrained(converted, out, overwrite=True)
    assert normswap.from_pretrained(out) is not None
    assert {p.name for p in tmp_path.iterdir()} == {"m", *mine}
    assert {name: snapshot(tmp_path / name) for name in mine} == mine


@pytest.mark.parametrize("when", ["swap", "writing"])
def test_a_killed_run_is_recovered_and_users_folders_kept(tmp_path, converted, when):
    out = tmp_path / "m"
    normswap.save_pretrained(converted, out)
    before = snapshot(out)
    kill_during(out, when)
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name != "m")
    assert len(leftovers) == (3 if when == "swap" else 2) and ".m.lock" in leftovers  # its journal
    assert (out.exists()) == (when == "writing")
    mine = user_folders(tmp_path, "m")
    with pytest.raises(NormswapError, match="exists: pass overwrite=True"):  # OUT restored first
        normswap.save_pretrained(converted, out)
    assert snapshot(out) == before
    assert {p.name for p in tmp_path.iterdir()} == {"m", *mine}
    assert {name: snapshot(tmp_path / name) for name in mine} == mine


@pytest.mark.parametrize("length", [246, 250, 255])
def test_long_out_names_are_written_and_replaced(tmp_path, converted, length):
    out = tmp_path / ("n" * length)
    normswap.save_pretrained(converted, out)
    normswap.save_pretrained(converted, out, overwrite=True)
    assert snapshot(out) and sorted(p.name for p in tmp_path.iterdir()) == [out.name]


def test_too_long_out_name_is_one_line(tmp_path, gpt2_dir):
    out = tmp_path / ("n" * 256)
    result = CliRunner().invoke(main, ["convert", str(gpt2_dir), "--to", "rmsnorm", "-o", str(out)])
    assert result.exit_code == 1 and result.output.strip().splitlines() == [
        f"error: the name of {out} is too long: the file system allows 255 bytes"]


def test_out_where_src_symlinks_point_is_refused(tmp_path, gpt2_dir):
    """A Hub-cache-like SRC: snapshot files are symlinks into blobs/. OUT=blobs would delete its data."""
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snap.mkdir(parents=True)
    for f in gpt2_dir.iterdir():
        (blobs / f.name).write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(blobs / f.name)
    before = snapshot(blobs)
    for out in (blobs, tmp_path / "blobs" / "config.json"):
        result = CliRunner().invoke(main, ["convert", str(snap), "--to", "rmsnorm", "-o", str(out),
                                           "--overwrite-any"])
        assert result.exit_code == 1 and "would replace SRC" in result.output
        assert "symlinks in it point there" in result.output
    assert snapshot(blobs) == before


def test_killed_right_after_the_exchange_leaves_the_new_out(tmp_path, converted):
    """Issue 33 (17): OUT is the old or the new folder at every instant: killed just after the swap, OUT is the
    new one, and the old one (under the journaled temp name) goes at the next write."""
    out = tmp_path / "m"
    normswap.save_pretrained(converted, out)
    kill_during(out, "exchange")
    assert json.loads((out / "config.json").read_text()) == {"normswap": {"who": "killed"}}
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name != "m")
    assert len(leftovers) == 2 and leftovers[0] == ".m.lock" and ".m.tmp-" in leftovers[1]
    normswap.save_pretrained(converted, out, overwrite="any")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"] and normswap.from_pretrained(out) is not None
