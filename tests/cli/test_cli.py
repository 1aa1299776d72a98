"""The `normswap` CLI: convert/inspect output and every error path (message + exit code)."""
import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

import normswap
import normswap.pipeline.convert
from normswap.cli import main

from helpers import CACHE
from helpers.tiny import tiny_model


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("src") / "llama"
    tiny_model("llama").save_pretrained(path)
    return path


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_convert_local_folder(gpt2_dir, tmp_path):
    out = tmp_path / "out"
    result = run("convert", gpt2_dir, "--to", "rmsnorm", "--method", "naive", "-o", out)
    assert result.exit_code == 0, result.output
    assert "converted 5 LayerNorm -> rmsnorm" in result.output
    assert "transformer.ln_f" in result.output
    assert "parity vs original (" in result.output and "KL" in result.output
    assert f"worst of 5 outputs: logits, {CACHE}[4]): max |Δ|" in result.output
    loaded = normswap.load(out)[0]
    assert len(loaded.config.normswap["norms"]) == 5


def test_convert_json(gpt2_dir, tmp_path):
    result = run("convert", gpt2_dir, "--to", "prmsnorm", "--p", "0.25", "--method", "naive",
                 "-o", tmp_path / "out", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["report"]["p"] == 0.25 and len(data["report"]["converted"]) == 5
    assert data["parity"]["max_rel"] > 0 and data["parity"]["kl"] > 0


def test_inspect(gpt2_dir, llama_dir):
    result = run("inspect", gpt2_dir)
    assert result.exit_code == 0
    assert "GPT2LMHeadModel: 5 LayerNorm to convert, 0 RMSNorm" in result.output
    assert "transformer.h.0.ln_1  LayerNorm width=32" in result.output
    result = run("inspect", llama_dir, "--json")
    rows = json.loads(result.stdout)["norms"]
    assert len(rows) == 5 and all(r["action"] == "already RMSNorm: kept" for r in rows)


def test_missing_path(tmp_path):
    result = run("convert", tmp_path / "nope", "--to", "rmsnorm", "-o", tmp_path / "out")
    assert result.exit_code == 1
    assert result.output.strip() == f"error: no such folder: {tmp_path / 'nope'}"


def test_hub_unreachable(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = run("convert", "some-org-xyz/some-model", "--to", "rmsnorm", "-o", tmp_path / "out")
    assert result.exit_code == 1
    assert "offline: cannot reach the Hugging Face Hub" in result.output and "pass a local folder" in result.output
    assert not (tmp_path / "out").exists()


def test_output_exists_without_overwrite(gpt2_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("x")
    result = run("convert", gpt2_dir, "--to", "rmsnorm", "-o", out)
    assert result.exit_code == 1 and "exists: pass --overwrite" in result.output
    assert [p.name for p in out.iterdir()] == ["keep"]


def test_overwrite_replaces(gpt2_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("x")
    result = run("convert", gpt2_dir, "--to", "rmsnorm", "--method", "naive", "-o", out, "--overwrite-any")
    assert result.exit_code == 0 and not (out / "keep").exists()


def test_nothing_to_convert(llama_dir, tmp_path):
    result = run("convert", llama_dir, "--to", "rmsnorm", "-o", tmp_path / "out")
    assert result.exit_code == 0
    assert "nothing to convert" in result.output and "5 RMSNorm already" in result.output
    assert not (tmp_path / "out").exists()


def test_file_instead_of_folder(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    result = run("convert", f, "--to", "rmsnorm", "-o", tmp_path / "out")
    assert result.exit_code == 1 and "is a file" in result.output


def test_folder_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    result = run("inspect", tmp_path / "empty")
    assert result.exit_code == 1 and "has no config.json" in result.output


def test_bad_p(gpt2_dir, tmp_path):
    result = run("convert", gpt2_dir, "--to", "prmsnorm", "--p", "2", "-o", tmp_path / "out")
    assert result.exit_code == 1 and "error: p must be in (0, 1], got 2.0" in result.output
    assert not (tmp_path / "out").exists()


def test_corrupt_weights_one_line(tmp_path, gpt2_dir):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((gpt2_dir / "config.json").read_text())
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    result = run("convert", bad, "--to", "rmsnorm", "-o", tmp_path / "out")
    assert result.exit_code == 1 and result.output.startswith(f"error: cannot load model from {bad}")
    assert len(result.output.strip().splitlines()) == 1


@pytest.mark.slow
def test_real_process_prints_one_line_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "normswap", "convert", str(tmp_path / "missing"), "--to",
                           "rmsnorm", "-o", str(tmp_path / "out")], capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [f"error: no such folder: {tmp_path / 'missing'}"]
    assert "Traceback" not in proc.stderr + proc.stdout


def test_failed_onnx_export_writes_nothing(gpt2_dir, tmp_path, monkeypatch):
    def failing_export(*a, **k):
        raise normswap.NormswapError("ORT parity 1e-2 above tolerance")
    monkeypatch.setattr(normswap.pipeline.convert, "export_onnx", failing_export)
    result = run("convert", gpt2_dir, "--to", "rmsnorm", "-o", tmp_path / "out", "--onnx", tmp_path / "m.onnx")
    assert result.exit_code == 1 and "error: ORT parity 1e-2 above tolerance" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("src", ["demo-rms/", "my model", "a/b/"])
def test_a_missing_folder_that_no_hub_id_could_be_is_named_missing(src, tmp_path, monkeypatch):
    """Issue 33 #9: `inspect demo-rms/` said "offline: cannot reach the Hub"; no Hub id ends with a slash."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = run("inspect", src)
    assert result.exit_code == 1 and result.output.strip() == f"error: no such folder: {src}", result.output


def test_version_imports_neither_torch_nor_transformers():
    """Issue 33 #15: `normswap --version` imported torch (every command module was imported up front)."""
    code = ("import sys; from normswap.cli import main\ntry:\n    main(['--version'], prog_name='normswap')\n"
            "except SystemExit:\n    pass\nprint([m for m in ('torch', 'transformers') if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.splitlines() == [f"normswap, version {normswap.__version__}", "[]"], proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_closed_pipe_ends_quietly(gpt2_dir):
    """Issue 33 #15: `normswap inspect ... | head -3` printed `error: BrokenPipeError`; the reader left, so stop
    quietly (click's exit 1 for a closed pipe)."""
    proc = subprocess.Popen([sys.executable, "-m", "normswap", "inspect", str(gpt2_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()   # before anything is written: the write gets EPIPE
    assert proc.wait(timeout=300) == 1 and proc.stderr.read().decode() == ""
