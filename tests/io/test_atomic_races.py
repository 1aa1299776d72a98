"""Issue 33 (17, 18, 21): what appears or changes while a run works is never replaced; the lock file is never
a symlink; OUT never lands inside SRC; the files are fsynced before the old OUT goes; ONNX files take the
same lock, and a killed export's staging folder goes at the next run."""
from __future__ import annotations

import os
import textwrap

import pytest

import normswap
from normswap.errors import NormswapError
from normswap.io import atomic, owned, rename

from helpers.cli import another_writer, one_error_line, run, snapshot
from helpers.export_models import converted as naive_conversion


@pytest.fixture(scope="module")
def converted():
    return naive_conversion("gpt2")


def _meanwhile(monkeypatch, act):
    """Run `act()` between atomic's first check and its swap (while the run works on its temp folder)."""
    real = rename.fsync_tree

    def working(path):
        act()
        return real(path)
    monkeypatch.setattr(rename, "fsync_tree", working)


USERS = {"notes.txt": b"mine"}


def _users_folder(path):
    path.mkdir()
    (path / "notes.txt").write_bytes(b"mine")


@pytest.mark.parametrize("overwrite", [False, True])
def test_out_created_meanwhile_is_left_alone(tmp_path, converted, monkeypatch, overwrite):
    out = tmp_path / "m"
    _meanwhile(monkeypatch, lambda: _users_folder(out))
    with pytest.raises(NormswapError, match="exists|was not written by normswap"):
        normswap.save_pretrained(converted, out, overwrite=overwrite)
    assert snapshot(out) == USERS and sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_empty_folder_created_meanwhile_is_not_replaced(tmp_path, converted, monkeypatch):
    """POSIX rename() replaces an empty folder: the swap must not."""
    out = tmp_path / "m"
    _meanwhile(monkeypatch, out.mkdir)
    with pytest.raises(NormswapError, match="exists"):
        normswap.save_pretrained(converted, out)
    assert out.is_dir() and not list(out.iterdir())


def test_out_appearing_at_the_rename_itself_is_kept(tmp_path, converted, monkeypatch):
    """Created after the last check, just before the rename: the rename refuses (no replace)."""
    out = tmp_path / "m"
    real, calls = atomic.check_replaceable, []

    def check(path, overwrite):
        real(path, overwrite)
        calls.append(path)
        if len(calls) == 2:   # the second check, at the swap
            out.mkdir()
    monkeypatch.setattr(atomic, "check_replaceable", check)
    with pytest.raises(NormswapError, match="appeared while normswap ran: it was left as it is, nothing written"):
        normswap.save_pretrained(converted, out)
    assert out.is_dir() and not list(out.iterdir()) and sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_out_replaced_meanwhile_by_a_users_folder_is_kept(tmp_path, converted, monkeypatch):
    out = tmp_path / "m"
    normswap.save_pretrained(converted, out)

    def swap_in_users():
        os.rename(out, tmp_path / "ours")
        _users_folder(out)
    _meanwhile(monkeypatch, swap_in_users)
    with pytest.raises(NormswapError, match="was not written by normswap"):
        normswap.save_pretrained(converted, out, overwrite=True)
    assert snapshot(out) == USERS


@pytest.mark.parametrize("dangling", [False, True])
def test_a_symlinked_lock_file_is_refused(tmp_path, converted, dangling):
    target = tmp_path / "precious.txt"
    if not dangling:
        target.write_text("keep")
    (tmp_path / ".m.lock").symlink_to(target)
    with pytest.raises(NormswapError, match=r"\.m\.lock is a symlink, not normswap's lock file: remove it"):
        normswap.save_pretrained(converted, tmp_path / "m")
    assert (target.read_text() == "keep") if not dangling else not target.exists()
    assert not (tmp_path / "m").exists()


def test_out_inside_src_through_a_symlink_is_refused(gpt2_dir, tmp_path):
    (tmp_path / "link").symlink_to(gpt2_dir)
    before = snapshot(gpt2_dir)
    line = one_error_line(run("convert", gpt2_dir, "--to", "rmsnorm", "-o", tmp_path / "link" / "sub"))
    assert line == f"error: {tmp_path / 'link' / 'sub'} is inside SRC {gpt2_dir} (through a symlink): " \
                   "write somewhere else"
    line = one_error_line(run("export", gpt2_dir, "-o", gpt2_dir / "deploy"))
    assert line == f"error: {gpt2_dir / 'deploy'} is inside SRC {gpt2_dir}: write somewhere else"
    assert snapshot(gpt2_dir) == before


def test_files_folder_and_parent_are_synced_before_the_old_out_goes(tmp_path, converted, monkeypatch):
    out = tmp_path / "m"
    normswap.save_pretrained(converted, out)
    events = []
    real_sync, real_remove = rename.fsync_path, atomic.shutil.rmtree
    monkeypatch.setattr(rename, "fsync_path", lambda p: (events.append(("sync", os.path.basename(p))),
                                                          real_sync(p)))
    monkeypatch.setattr(atomic.shutil, "rmtree", lambda p, **k: (events.append(("remove", os.path.basename(p))),
                                                                 real_remove(p, **k)))
    normswap.save_pretrained(converted, out, overwrite=True)
    synced = [name for kind, name in events if kind == "sync"]
    assert {"model.normswap.safetensors", "config.json"} <= set(synced)
    assert synced[-1] == tmp_path.name   # the parent, after the rename
    first_remove = next(i for i, (kind, _) in enumerate(events) if kind == "remove")
    assert events.index(("sync", tmp_path.name)) < first_remove


# --- ONNX files (the export itself stubbed: what is tested is where its files go) -------------------------------

@pytest.fixture
def quick_export(monkeypatch):
    """export_onnx's build writes a tiny graph marked as normswap's (and `.data` beside it when asked to)."""
    import onnx
    from normswap.export import onnx as exporter

    def build(model, staged, final, target, fp16, with_past, opset, validate, external_data_bytes, *rest, **kw):
        graph = onnx.helper.make_model(onnx.helper.make_graph([], "g", [], []))
        onnx.helper.set_model_props(graph, {owned.ONNX_MARK: "ort"})
        onnx.save(graph, str(staged))
        if external_data_bytes == 0:
            staged.with_name(staged.name + ".data").write_bytes(b"weights")
    monkeypatch.setattr(exporter, "build", build)


def test_onnx_file_created_meanwhile_is_left_alone(tmp_path, converted, monkeypatch, quick_export):
    path = tmp_path / "m.onnx"
    _meanwhile(monkeypatch, lambda: path.write_bytes(b"users"))
    with pytest.raises(NormswapError, match="exists: pass overwrite=True"):
        normswap.export_onnx(converted, path)
    assert path.read_bytes() == b"users" and sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_users_external_data_file_is_not_replaced(tmp_path, converted, quick_export):
    path, data = tmp_path / "m.onnx", tmp_path / "m.onnx.data"
    data.write_bytes(b"users")
    with pytest.raises(NormswapError, match=r"m\.onnx\.data exists: pass overwrite=True"):
        normswap.export_onnx(converted, path, external_data_bytes=0)
    with pytest.raises(NormswapError, match=r"m\.onnx\.data is not the data of an ONNX file normswap exported"):
        normswap.export_onnx(converted, path, external_data_bytes=0, overwrite=True)
    assert data.read_bytes() == b"users" and not path.exists()
    data.unlink()
    normswap.export_onnx(converted, path, external_data_bytes=0)
    data.write_bytes(b"old")
    normswap.export_onnx(converted, path, external_data_bytes=0, overwrite=True)   # its own data: replaced
    assert data.read_bytes() == b"weights" and sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx.data"]


HOLDER = textwrap.dedent("""
    import sys, time, types
    from pathlib import Path
    pkg = sys.modules["normswap"] = types.ModuleType("normswap")  # atomic.py alone: no torch import
    pkg.__path__ = [sys.argv[3]]
    from normswap.io.atomic import atomic_files
    path, go = Path(sys.argv[1]), Path(sys.argv[2])
    with atomic_files(path, lambda: None) as tmp:
        (tmp / path.name).write_bytes(b"first")
        go.write_text("holding")
        while go.exists():
            time.sleep(0.05)
""")


def test_second_onnx_export_to_the_same_file_fails_at_once(tmp_path, converted, quick_export):
    path, go = tmp_path / "m.onnx", tmp_path / "go"
    with another_writer(HOLDER, path, go) as first, \
            pytest.raises(NormswapError, match=rf"being written by another normswap process \(pid {first.pid}\)"):
        normswap.export_onnx(converted, path, overwrite=True)
    assert path.read_bytes() == b"first" and sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_a_killed_exports_staging_folder_goes_at_the_next_run(tmp_path, converted, quick_export):
    path = tmp_path / "m.onnx"
    staging = tmp_path / ".m.onnx.tmp-4242-deadbeef"
    staging.mkdir()
    (staging / "m.onnx").write_bytes(b"half")
    (tmp_path / ".m.onnx.lock").write_text(f"4242\ntmp {staging.name}\n")   # the journal a killed run leaves
    normswap.export_onnx(converted, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"] and owned.exported_onnx(path)
