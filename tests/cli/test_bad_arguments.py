"""Bad arguments, to the library or the CLI, get a one-line answer naming what is wrong, never a traceback
or a silently accepted bad value; library errors name parameters, the CLI's name flags (issue 20)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch
import transformers

import normswap
from normswap.errors import NormswapError

from helpers.cli import one_error_line, run
from helpers.tiny import _config, tiny_model


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
    normswap.save(model, tmp_path / "m")
    for name, want in [("fp16", torch.float16), (torch.bfloat16, torch.bfloat16), ("torch.float32", torch.float32)]:
        assert next(normswap.load(tmp_path / "m", dtype=name)[0].parameters()).dtype == want
    with pytest.raises(NormswapError, match="unknown dtype 'fp8': choose float32"):
        normswap.load(tmp_path / "m", dtype="fp8")[0]


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
        normswap.save(model, tmp_path / "m", max_shard_size=size)
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
