"""CLI conventions: --device, --dtype, -q/-v, warnings on stderr, progress only on a terminal."""
from __future__ import annotations

import json
import warnings

import pytest
import torch
from click.testing import CliRunner

from normswap import progress
from normswap.cli.options import Shared
from normswap.cli import main
from normswap.pipeline import resolve_device


def _run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_resolve_device():
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("CPU") == torch.device("cpu")
    with pytest.raises(Exception, match="unknown device 'gpu0'"):
        resolve_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(Exception, match="no CUDA device"):
            resolve_device("cuda:1")


@pytest.mark.parametrize("cmd", [["convert", "--to", "rmsnorm", "-o", "unused"], ["eval"],
                                 ["export", "--onnx", "unused.onnx"]])
def test_bad_device_is_one_line(cmd, tmp_path):
    r = _run(cmd[0], "normswap-demo", *cmd[1:], "--device", "tpu9")
    assert r.exit_code == 1 and r.stderr.strip().startswith("error: unknown device 'tpu9'"), r.output
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_dtype_short_names(tmp_path):
    r = _run("convert", "normswap-demo", "--to", "rmsnorm", "--dtype", "bf16", "--device", "cpu", "-o",
             tmp_path / "o", "--json")
    assert r.exit_code == 0, r.output
    cfg = json.loads((tmp_path / "o" / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16"
    assert _run("inspect", "normswap-demo", "--dtype", "fp64").exit_code == 2  # not a choice


def test_fallback_warning_goes_to_stderr(tmp_path):
    from transformers import BertConfig, BertModel

    import normswap
    torch.manual_seed(0)
    normswap.save(BertModel(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                       num_attention_heads=2, intermediate_size=32)), tmp_path / "b")
    r = _run("convert", tmp_path / "b", "--to", "rmsnorm", "-o", tmp_path / "o", "--json")
    assert r.exit_code == 0, r.output
    json.loads(r.stdout)  # stdout stays one JSON object
    assert "warning: no exact conversion" in r.stderr and "fell back to naive" in r.stderr
    q = _run("-q", "convert", tmp_path / "b", "--to", "rmsnorm", "-o", tmp_path / "o2")
    assert q.exit_code == 0 and "warning: no exact conversion" in q.stderr  # -q silences libraries, not us


def test_library_warnings_shown_by_default_and_hidden_by_q():
    from normswap.cli.options import Shared, setup_output
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        setup_output(Shared(verbosity=0))
        warnings.warn("library says hi", UserWarning)
    assert [str(w.message) for w in seen] == ["library says hi"]
    with warnings.catch_warnings(record=True) as seen:
        setup_output(Shared(verbosity=-1))
        warnings.warn("library says hi again", UserWarning)
    assert seen == []


@pytest.mark.slow
def test_progress_off_without_a_terminal(tmp_path):
    r = _run("convert", "normswap-demo", "--to", "rmsnorm", "-o", tmp_path / "o")
    assert r.exit_code == 0 and "\r" not in r.stderr  # CliRunner's stderr is not a TTY: no bars
    assert not Shared(verbosity=0).show_progress   # what every command passes down: no TTY here
    with progress.bar(total=3, desc="x", unit="B", unit_scale=True) as manual:   # off: a do-nothing stand-in
        assert not hasattr(manual, "n")
        manual.update(2)
    bar = progress.bar(range(3), desc="x", enabled=True)
    assert hasattr(bar, "n") and list(bar) == [0, 1, 2]   # on: a real tqdm bar


def test_a_library_warning_prints_as_one_warning_line(monkeypatch):
    """A folder's load warning (issue 33 #11: every exact folder names its not-preserved outputs) printed as
    `file:line: UserWarning: ...` plus the source line; the CLI prints it as its own warnings."""
    from normswap.cli.options import Shared, setup_output
    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)   # put back after the test
    setup_output(Shared(verbosity=0))
    assert warnings.formatwarning("out/: keeps the outputs\nexcept x", UserWarning, "rebuild.py", 107) == \
        "warning: out/: keeps the outputs except x\n"
