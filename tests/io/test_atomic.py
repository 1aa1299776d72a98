"""Your files are safe: OUT never replaces an input or a foreign folder, swaps roll back, runs recover.

Also the CLI's error contract: one line, exit 1 (runtime), 2 (usage), 143 (SIGTERM); binary data refused.
"""
from __future__ import annotations

import os
import signal
import textwrap

import pytest
from click.testing import CliRunner

import normswap
from normswap import textdata
from normswap.cli import main
from normswap.models.demo import DEMO_DIR
from normswap.errors import NormswapError
from normswap.io import rename

from helpers.cli import another_writer, one_error_line, run, snapshot
from helpers.tiny import tiny_model


@pytest.fixture(scope="module")
def converted():
    model = tiny_model("gpt2")
    normswap.convert(model, method="naive", to="rmsnorm")
    return model


def own_output(path, model):
    normswap.save_pretrained(model, path)
    return snapshot(path)


# --- 13.5: what --overwrite may replace -------------------------------------------------------------

def test_out_holding_src_is_refused(gpt2_dir, tmp_path):
    anc = tmp_path / "anc"
    src = anc / "src"
    src.parent.mkdir()
    (anc / "keepme").mkdir()
    (anc / "keepme" / "notes.txt").write_text("mine")
    tiny_model("gpt2").save_pretrained(src)
    before = snapshot(anc)
    (tmp_path / "link").symlink_to(src)
    for out in (anc, src, src / "..", tmp_path / "link"):
        line = one_error_line(run("convert", src, "--to", "rmsnorm", "-o", out, "--overwrite-any"))
        assert "would replace SRC" in line
    assert snapshot(anc) == before and sorted(p.name for p in tmp_path.iterdir()) == ["anc", "link"]


def test_heal_out_holding_teacher_or_data_is_refused(gpt2_dir, tmp_path):
    data = tmp_path / "d" / "text.txt"
    data.parent.mkdir()
    data.write_text("Some text to heal on. " * 20)
    for src, teacher, out, what in [(gpt2_dir, gpt2_dir, data.parent, "--data"),
                                    ("normswap-demo", gpt2_dir, gpt2_dir.parent, "--teacher"),
                                    (gpt2_dir, "normswap-demo", DEMO_DIR, "--teacher")]:
        line = one_error_line(run("heal", src, "--teacher", teacher, "--data", data, "-o", out, "--overwrite-any"))
        assert f"would replace {what}" in line
    assert data.read_text().startswith("Some text")


def test_foreign_folder_needs_overwrite_any(gpt2_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    line = one_error_line(run("convert", gpt2_dir, "--to", "rmsnorm", "-o", out, "--overwrite"))
    assert "was not written by normswap" in line and "--overwrite-any" in line
    assert (out / "notes.txt").read_text() == "mine"
    result = run("convert", gpt2_dir, "--to", "rmsnorm", "-o", out, "--overwrite-any")
    assert result.exit_code == 0 and not (out / "notes.txt").exists() and (out / "model.normswap.safetensors").exists()


def test_own_output_with_extra_files_needs_overwrite_any(gpt2_dir, tmp_path, converted):
    out = tmp_path / "out"
    own_output(out, converted)
    (out / "notes.txt").write_text("mine")
    (out / "sub").mkdir()
    line = one_error_line(run("convert", gpt2_dir, "--to", "rmsnorm", "-o", out, "--overwrite"))
    assert "holds files normswap does not write (notes.txt, sub)" in line
    (out / "notes.txt").unlink()
    (out / "sub").rmdir()
    assert run("convert", gpt2_dir, "--to", "rmsnorm", "-o", out, "--overwrite").exit_code == 0
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run("convert", gpt2_dir, "--to", "rmsnorm", "-o", empty, "--overwrite").exit_code == 0


@pytest.mark.parametrize("out", [".", "", "..", "./"])
def test_current_folder_or_empty_out_is_refused(gpt2_dir, tmp_path, monkeypatch, out):
    work = tmp_path / "w" / "here"
    work.mkdir(parents=True)
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    line = one_error_line(run("convert", gpt2_dir, "--to", "rmsnorm", "-o", out, "--overwrite-any"))
    assert "current folder" in line or "empty" in line
    assert sorted(p.name for p in work.iterdir()) == ["notes.txt"]
    assert sorted(p.name for p in work.parent.iterdir()) == ["here"]


def test_onnx_inside_out_is_refused(gpt2_dir, tmp_path):
    out = tmp_path / "out"
    line = one_error_line(run("convert", gpt2_dir, "--to", "rmsnorm", "-o", out, "--onnx", out / "m.onnx"))
    assert "inside OUT" in line and not out.exists()


def test_export_never_replaces_a_foreign_file(tmp_path, converted):
    src, mine = tmp_path / "src", tmp_path / "mine"
    before = own_output(src, converted)
    mine.mkdir()
    (mine / "config.json").write_bytes((src / "config.json").read_bytes())
    config = (mine / "config.json").read_bytes()
    for cmd in (["export", src], ["convert", src, "--to", "rmsnorm", "-o", tmp_path / "o"]):
        line = one_error_line(run(*cmd, "--onnx", mine / "config.json", "--overwrite"))
        assert line == f"error: {mine / 'config.json'} is not an ONNX file normswap exported: " \
                       "pass --overwrite-any to replace it"
        line = one_error_line(run(*cmd, "--onnx", src / "m.onnx"))   # nothing is written inside SRC
        assert line == f"error: {src / 'm.onnx'} is inside SRC {src}: write somewhere else"
    assert (mine / "config.json").read_bytes() == config and not (tmp_path / "o").exists()
    assert snapshot(src) == before


# --- 13.6: the swap rolls back, killed runs are recovered, one writer at a time ---------------------

def _fail_second_rename(monkeypatch, exc):
    """On a file system that cannot exchange two paths: moving the finished temp folder onto OUT (after the
    old OUT was renamed aside) raises `exc`."""
    real = rename.rename_new

    def fake(src, dst):
        if ".tmp-" in os.path.basename(src) and not os.path.basename(dst).startswith("."):
            raise exc
        return real(src, dst)
    monkeypatch.setattr(rename, "exchange", lambda a, b: False)
    monkeypatch.setattr(rename, "rename_new", fake)


@pytest.mark.parametrize("exc", [OSError("disk gone"), KeyboardInterrupt()])
def test_failed_second_rename_restores_old_out(tmp_path, converted, monkeypatch, exc):
    out = tmp_path / "m"
    before = own_output(out, converted)
    _fail_second_rename(monkeypatch, exc)
    with pytest.raises(type(exc)):
        normswap.save_pretrained(converted, out, overwrite=True)
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temp, no old, no lock left


def test_output_folder_honours_umask(tmp_path, converted):
    mask = os.umask(0o022)
    try:
        normswap.save_pretrained(converted, tmp_path / "m")
    finally:
        os.umask(mask)
    assert (tmp_path / "m").stat().st_mode & 0o777 == 0o755


WRITER = textwrap.dedent("""
    import sys, time, types
    from pathlib import Path
    pkg = sys.modules["normswap"] = types.ModuleType("normswap")  # atomic.py alone: no torch import
    pkg.__path__ = [sys.argv[3]]
    from normswap.io.atomic import atomic_dir
    out, go = Path(sys.argv[1]), Path(sys.argv[2])
    with atomic_dir(out) as tmp:
        (tmp / "config.json").write_text('{"normswap": {"who": "first"}}')
        (tmp / "model.safetensors").write_bytes(b"first")
        go.write_text("holding")
        while go.exists():
            time.sleep(0.05)
""")


def test_concurrent_writer_fails_and_first_wins_whole(tmp_path, converted):
    out, go = tmp_path / "m", tmp_path / "go"
    with another_writer(WRITER, out, go) as first, \
            pytest.raises(NormswapError, match=rf"being written by another normswap process \(pid {first.pid}\)"):
        normswap.save_pretrained(converted, out, overwrite=True)
    assert snapshot(out) == {"config.json": b'{"normswap": {"who": "first"}}', "model.safetensors": b"first"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def _term_then(fn):
    def inner(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)  # lands at once, in the CLI's handler
        return fn(*a, **k)
    return inner


@pytest.mark.parametrize("where", ["writing", "swap"])
def test_sigterm_cleans_up_and_says_what_was_written(gpt2_dir, tmp_path, converted, monkeypatch, where):
    out = tmp_path / "out"
    if where == "swap":  # an older output of ours, told apart by a marker
        own_output(out, converted)
        (out / "config.json").write_text((out / "config.json").read_text().replace("{", '{"old": 1,', 1))
    if where == "writing":
        from normswap.io import safetensors as shards
        monkeypatch.setattr(shards, "save_model", _term_then(shards.save_model))
    else:  # at the swap: held until OUT is whole, then delivered
        monkeypatch.setattr(rename, "exchange", _term_then(rename.exchange))
    result = CliRunner().invoke(main, ["convert", str(gpt2_dir), "--to", "rmsnorm", "--method", "naive",
                                       "-o", str(out), "--overwrite"])
    assert result.exit_code == 143 and "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == (["out"] if where == "swap" else [])
    if where == "writing":
        assert result.stderr.strip() == "interrupted: nothing was written"
    else:
        assert result.stderr.strip() == f"interrupted: {out} written"
        assert '"old"' not in (out / "config.json").read_text() and normswap.from_pretrained(out) is not None
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the CLI's handler is removed again


# --- 13.12: usage errors and binary data --------------------------------------------------------------

def test_usage_error_is_one_line_exit_2(gpt2_dir, tmp_path):
    line = one_error_line(run("convert", gpt2_dir, "-o", tmp_path / "o"), code=2)
    assert "Missing option '--to'" in line and "convert --help')" in line
    assert "No such command" in one_error_line(run("convrt"), code=2)
    bare = run()
    assert bare.exit_code == 0 and "Commands:" in bare.stdout  # plain `normswap` still shows the help
    result = run("convert", "x", "--to", "layernorm", "-o", tmp_path / "o")
    assert result.stdout == "" and result.stderr.startswith("error: Invalid value for '--to'")
    assert one_error_line(result, code=2) and not (tmp_path / "o").exists()


@pytest.mark.parametrize("content", [b"\x00" * 4096, b"ok text\x00 with one NUL", bytes(range(1, 32)) * 50])
def test_binary_text_data_is_refused(tmp_path, content):
    data = tmp_path / "data.txt"
    data.write_bytes(content)
    line = one_error_line(run("eval", "normswap-demo", "--data", data))
    assert line == f"error: {data} is not text (NUL or control bytes): pass plain text files"
    with pytest.raises(NormswapError, match="is not text"):
        textdata.read_texts([data])
    assert textdata.read_texts([_prose(tmp_path)])  # tabs, newlines, form feeds are text


def _prose(tmp_path):
    p = tmp_path / "prose.txt"
    p.write_text("Chapter 1\n\n\tIt is a truth universally acknowledged.\r\n\fNext page.\n")
    return p
