"""heal's outputs (issue 33 #20, and the kept-files rule): OUT's lock held from before training, every output path
checked before any work, and SRC's other files kept in OUT as convert keeps them."""
from __future__ import annotations

import json
import sys

import pytest
from helpers.cli import one_error_line, run, snapshot
from helpers.heal_models import save_pair, text, tokenizer

from normswap.errors import NormswapError
from normswap.healing import loop
from normswap.healing.options import HealOptions
from normswap.io import kept
from normswap.io.atomic import held
from normswap.pipeline import ConvertOptions, HealCheckpointOptions, convert_checkpoint, heal_checkpoint

FAST = HealOptions(steps=1, seq_len=16, batch_size=2)
MODULES = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
           {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
EXTRA = {"README.md": "# a model card\n", "merges.txt": "#version: 0.2\n", "chat_template.jinja": "{{ messages }}",
         "modules.json": json.dumps(MODULES), "1_Pooling/config.json": '{"pooling_mode_mean_tokens": true}'}
LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/sys: a folder nobody can write in")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """d/orig (with a model card, merges, a chat template, sentence-transformers modules), d/src (its naive
    conversion, keeping them), d/train.txt."""
    d = save_pair(tmp_path_factory.mktemp("heal"), tokenizer(), text(600))
    for name, content in EXTRA.items():
        (d / "orig" / name).parent.mkdir(exist_ok=True)
        (d / "orig" / name).write_text(content)
    convert_checkpoint(str(d / "orig"), d / "src", ConvertOptions(method="naive", device="cpu"))
    return d


def options(d, **kw) -> HealCheckpointOptions:
    return HealCheckpointOptions(teacher=str(d / "orig"), data=(str(d / "train.txt"),), heal=FAST, device="cpu",
                                 **kw)


@pytest.fixture
def no_training(monkeypatch):
    """Training would start where `prepare` is called: a test that reaches it fails."""
    def trained(*_, **__):
        raise AssertionError("the run got to training")
    monkeypatch.setattr(loop, "prepare", trained)


def test_heal_keeps_the_sources_files(pair, tmp_path):
    """The source's files against heal's output's: each kept file byte for byte and listed. Before: OUT had
    only config, weights, modeling file, tokenizer and heal_log.json."""
    heal_checkpoint(str(pair / "src"), tmp_path / "out", options(pair))
    src, out = snapshot(pair / "src"), snapshot(tmp_path / "out")
    names = kept.kept(pair / "src")
    assert set(EXTRA) <= set(names) and set(names) <= set(out)
    assert {n: out[n] for n in EXTRA} == {n: src[n] for n in EXTRA}
    listed = json.loads((tmp_path / "out" / "config.json").read_text())[kept.KEY]
    assert set(listed) == set(names) | {"1_Pooling"}


def test_a_second_heal_of_the_same_out_fails_before_training(pair, tmp_path, no_training):
    """Issue 33 #20: the second of two `heal -o OUT` trained to the end, then failed on OUT's lock."""
    with held(tmp_path / "out"):   # another writer of OUT (a lock is the file's, whichever process holds it)
        with pytest.raises(NormswapError, match=r"out is being written by another normswap process \(pid \d+\)"):
            heal_checkpoint(str(pair / "src"), tmp_path / "out", options(pair))
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_heal_releases_the_lock_it_held(pair, tmp_path):
    heal_checkpoint(str(pair / "src"), tmp_path / "out", options(pair))
    with held(tmp_path / "out"):   # free again
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("where", [
    pytest.param("-o /sys/normswap-out", marks=LINUX),
    pytest.param("--plot /sys/normswap-curves.png", marks=LINUX),
    "-o {tmp}/plot.png/out", "--plot {tmp}/plot.png/x.png"])
def test_every_output_path_is_checked_before_any_work(pair, tmp_path, no_training, where):
    """Issue 33 #20: an OUT or --plot in a folder nobody can write in (or under a file) failed only after training
    and saving."""
    (tmp_path / "plot.png").write_text("a file")
    flag, path = where.format(tmp=tmp_path).split()
    args = ["heal", pair / "src", "--teacher", pair / "orig", "--data", pair / "train.txt", "--steps", "1",
            "--device", "cpu"] + ([] if flag == "-o" else ["-o", tmp_path / "out"]) + [flag, path]
    line = one_error_line(run(*args))
    assert line.startswith("error: cannot write to /sys: ") or line == f"error: cannot write to {tmp_path}/plot.png: " \
        "not a folder", line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot.png"]


def test_a_plot_that_is_a_folder_is_named_so(pair, tmp_path, no_training):
    (tmp_path / "curves.png").mkdir()
    line = one_error_line(run("heal", pair / "src", "--teacher", pair / "orig", "--data", pair / "train.txt",
                              "-o", tmp_path / "out", "--plot", tmp_path / "curves.png", "--overwrite"))
    assert line == f"error: {tmp_path / 'curves.png'} exists and is a folder"


@LINUX
@pytest.mark.parametrize("args", [["convert", "normswap-demo", "--to", "rmsnorm", "-o", "{tmp}/out", "--onnx",
                                   "/sys/normswap.onnx"],
                                  ["export", "normswap-demo", "--onnx", "/sys/normswap.onnx"],
                                  ["export", "normswap-demo", "-o", "/sys/normswap-onnx"]])
def test_convert_and_export_check_their_outputs_first(tmp_path, args, monkeypatch):
    """Before: refused with the same words, after loading and converting the model."""
    import normswap.pipeline.convert as convert
    import normswap.pipeline.export as export

    def loaded(*_, **__):
        raise AssertionError("the run loaded the model")
    monkeypatch.setattr(convert, "load_model", loaded)
    monkeypatch.setattr(export, "load_model", loaded)
    line = one_error_line(run(*[a.format(tmp=tmp_path) for a in args]))
    assert line.startswith("error: cannot write to /sys: ")
    assert list(tmp_path.iterdir()) == []
