"""Issue 20 (6, 8, 9): careless or hostile inputs get a one-line answer, never a traceback, a misleading
reason or a silently accepted bad value."""
from __future__ import annotations

import ast
import json
import os
import re
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch
import transformers

import normswap
from normswap.checkpoint import safetensors
from normswap.errors import NormswapError
from normswap.models.load import LoadOptions
from normswap.pipeline import ConvertOptions, convert_checkpoint

from helpers.cli import one_error_line, run
from helpers.tiny import _config, tiny_model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    tiny_model("llama").save_pretrained(root / "llama")
    tiny_model("gpt2").save_pretrained(root / "broken")
    config = json.loads((root / "broken" / "config.json").read_text())
    (root / "broken" / "config.json").write_text(json.dumps({**config, "layer_norm_epsilon": -1.0}))
    return root


def test_nothing_to_convert_prints_json_and_exits_0(folders, tmp_path):
    r = run("convert", folders / "llama", "--to", "rmsnorm", "-o", tmp_path / "o", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["report"]["converted"] == [] and len(out["report"]["already_rms"]) == 5
    assert out["message"] == f"nothing to convert: {folders / 'llama'} has no LayerNorm normswap can convert " \
                             "(5 RMSNorm already)"
    assert not (tmp_path / "o").exists()


def test_broken_norms_are_an_error_saying_why(folders, tmp_path):
    line = one_error_line(run("convert", folders / "broken", "--to", "rmsnorm", "-o", tmp_path / "o"))
    assert "5 LayerNorm-like modules (transformer.h.0.ln_1" in line and "give NaN/inf" in line
    in_memory = ConvertOptions(load=LoadOptions(allow_missing_weights=True))   # not streamed
    with pytest.raises(NormswapError, match="the model is broken"):
        convert_checkpoint(str(folders / "broken"), tmp_path / "o", in_memory)
    assert not (tmp_path / "o").exists()


def test_api_refuses_what_is_not_a_loaded_model(tmp_path):
    with pytest.raises(NormswapError, match="model must be a torch.nn.Module, not NoneType"):
        normswap.convert(None)
    with torch.device("meta"):
        empty = transformers.GPT2LMHeadModel(_config("gpt2"))
    with pytest.raises(NormswapError, match="on the meta device"):
        normswap.convert(empty)


def test_dtype_names_and_torch_dtypes_are_accepted(tmp_path):
    model = tiny_model("gpt2")
    normswap.convert(model, method="naive")
    normswap.save_pretrained(model, tmp_path / "m")
    for name, want in [("fp16", torch.float16), (torch.bfloat16, torch.bfloat16), ("torch.float32", torch.float32)]:
        assert next(normswap.from_pretrained(tmp_path / "m", dtype=name).parameters()).dtype == want
    with pytest.raises(NormswapError, match="unknown dtype 'fp8': choose float32"):
        normswap.from_pretrained(tmp_path / "m", dtype="fp8")


@pytest.mark.parametrize("shape", [0, -3, True, 2.5, (4, 4), ()])
def test_norm_widths_are_checked_at_construction(shape):
    for cls in (normswap.RMSNorm, normswap.PartialRMSNorm):
        with pytest.raises(ValueError, match="normalized_shape must be a positive int"):
            cls(shape)
    assert normswap.RMSNorm([6]).normalized_shape == 6


@pytest.mark.parametrize("size", [0, -5, "0.0001KB", "0B", True])
def test_bad_shard_sizes_are_refused_before_anything(tmp_path, size):
    model = tiny_model("gpt2")
    with pytest.raises(NormswapError, match="bad shard size"):
        normswap.save_pretrained(model, tmp_path / "m", max_shard_size=size)
    if not isinstance(size, bool):
        assert "--max-shard-size" in one_error_line(run("convert", "normswap-demo", "--to", "rmsnorm", "-o",
                                                        tmp_path / "m", "--max-shard-size", size))
    assert list(tmp_path.iterdir()) == []


def test_onnx_path_naming_a_folder_is_refused(tmp_path):
    for args in (["export", "normswap-demo"], ["convert", "normswap-demo", "--to", "rmsnorm", "-o", tmp_path / "o"]):
        line = one_error_line(run(*args, "--onnx", f"{tmp_path / 'name'}/"))
        assert line == f"error: --onnx {tmp_path / 'name'}/ names a folder: give a file name " \
                       f"(e.g. {tmp_path / 'name'}/model.onnx)"
    assert list(tmp_path.iterdir()) == []


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


def test_library_errors_name_parameters_not_flags():
    """Outside normswap/cli, an error message names `parameter=value`, never a --flag (the CLI maps them)."""
    package = Path(normswap.__file__).parent
    found = []
    for f in sorted(package.rglob("*.py")):
        if "cli" in f.relative_to(package).parts:
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "NormswapError":
                text = " ".join(n.value for n in ast.walk(node) if isinstance(n, ast.Constant)
                                and isinstance(n.value, str))
                if re.search(r"(?<![\w-])--[a-z]", text) and "accelerate launch" not in text:
                    found.append(f"{f.name}: {text[:80]}")
    assert found == []
