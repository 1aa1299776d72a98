"""The CLI's options and the flag names its errors show are generated from the options dataclasses."""
from __future__ import annotations

import dataclasses

import click
import pytest
import torch

from normswap.cli import main
from normswap.cli.flags import build, error_names
from normswap.errors import NormswapError
from normswap.healing.options import HealOptions, LoraOptions
from normswap.models.load import LoadOptions
from normswap.models.source import DTYPE_NAMES
from normswap.pipeline.options import ConvertOptions, ExportOptions, HealCheckpointOptions

# The table errors.FLAGS held by hand before it was generated: every entry must still read the same.
HAND_KEPT = {
    "overwrite=True": "--overwrite", "overwrite='any'": "--overwrite-any",
    "allow_missing_weights=True": "--allow-missing-weights", "trust_remote_code=True": "--trust-remote-code",
    "method='naive'": "--method naive", "method='auto'": "--method auto", "to='prmsnorm'": "--to prmsnorm",
    "train='all'": "--train all", "objective='lm'": "--objective lm", "texts": "--data FILE", "data": "--data",
    "finetune_steps": "--finetune-steps", "onnx": "--onnx", "src": "SRC", "out": "OUT", "teacher": "--teacher",
    "with_past=True": "--with-past", "device": "--device", "reference": "--reference ORIG", "lr": "--lr",
    "max_shard_size": "--max-shard-size", "dtype": "--dtype",
    "train='lora'": "--train lora", "lora.rank": "--lora-rank",
    "lora.alpha": "--lora-alpha", "lora.targets": "--lora-targets", "eval_every": "--eval-every",
    "eval_fraction": "--eval-fraction", "eval_windows": "--eval-windows", "eval_texts": "--eval-data",
    "early_stop=True": "--early-stop", "patience": "--patience", "report_to": "--report-to",
    "logging_dir": "--logging-dir",
}


def test_errors_name_the_flags_the_dataclasses_declare():
    names = main.flag_names()
    assert {k: names.get(k) for k in HAND_KEPT} == HAND_KEPT
    err = NormswapError("`lora.rank` must be >= 1; pass `overwrite='any'` or `method='naive'`, not `other`")
    assert err.for_cli(names) == "--lora-rank must be >= 1; pass --overwrite-any or --method naive, not other"
    assert str(err) == "lora.rank must be >= 1; pass overwrite='any' or method='naive', not other"


def test_every_command_spells_each_name_alike():
    classes = [main.get_command(None, n).callback.options_class for n in main.list_commands(None)]
    union = main.flag_names()
    for cls in classes:
        assert error_names(cls).items() <= union.items(), cls.__name__


def _flags(command) -> set[str]:
    return {o for p in command.params if isinstance(p, click.Option) for o in p.opts + p.secondary_opts}


def test_each_command_has_one_flag_per_field_and_its_switches():
    convert, heal, export = (main.get_command(None, n) for n in ("convert", "heal", "export"))
    assert _flags(convert) == {"--to", "--method", "--p", "--dtype", "--trust-remote-code", "--allow-missing-weights",
                               "--device", "--finetune-steps", "--data", "--onnx", "--max-shard-size", "--overwrite",
                               "--overwrite-any", "-o", "--output", "--json", "--inputs", "--rotate",
                               "--rotate-method", "--seed", "--rotate-heads", "--rotate-online"}
    fields = {f.name for f in dataclasses.fields(HealOptions)} - {"lora"}
    assert {f"--{n.replace('_', '-')}" for n in fields - {"eval_texts"}} | {"--eval-data"} <= _flags(heal)
    assert {"--lora-rank", "--lora-alpha", "--lora-targets", "--lora-norms", "--no-lora-norms"} <= _flags(heal)
    assert {"--dtype", "--fp16", "--with-past", "--no-past", "--opset", "--target", "--quantize"} <= _flags(export)
    assert "--trust-remote-code" in _flags(export)
    dtype = next(p for p in main.get_command(None, "inspect").params if p.name == "load__dtype")
    assert list(dtype.type.choices) == list(DTYPE_NAMES)


def _parse(name: str, *args: str) -> dict:
    command = main.get_command(None, name)
    return dict(command.make_context(name, list(args)).params)


def test_parsed_flags_build_the_options_object():
    kw = _parse("convert", "SRC", "-o", "OUT", "--to", "prmsnorm", "--dtype", "bf16", "--overwrite-any",
                "--data", "a.txt", "--data", "b.txt", "--p", "0.25")
    assert build(ConvertOptions, kw, show_progress=True) == ConvertOptions(
        to="prmsnorm", p=0.25, load=LoadOptions(dtype="bfloat16"), data=("a.txt", "b.txt"), max_shard_size="50GB",
        overwrite="any", show_progress=True)
    assert set(kw) == {"src", "out", "as_json"}   # what the command itself reads
    kw = _parse("heal", "SRC", "-o", "OUT", "--teacher", "T", "--train", "lora", "--lora-rank", "8",
                "--no-lora-norms", "--lr", "0.5", "--report-to", "none", "--fsdp")
    assert build(HealCheckpointOptions, kw) == HealCheckpointOptions(
        teacher="T", heal=HealOptions(train="lora", lr=0.5, lora=LoraOptions(rank=8, norms=False)), fsdp=True)
    kw = _parse("export", "SRC", "--onnx", "m.onnx", "--fp16", "--no-past")
    assert build(ExportOptions, kw, skip=("load.dtype",)) == ExportOptions(onnx="m.onnx", dtype="fp16",
                                                                          with_past=False)
    kw = _parse("convert", "SRC", "-o", "OUT", "--to", "rmsnorm", "--method", "exact", "--rotate", "--rotate-method",
                "random", "--seed", "3")
    assert build(ConvertOptions, kw) == ConvertOptions(method="exact", rotate=True, rotate_method="random", seed=3,
                                                       max_shard_size="50GB")
    kw = _parse("export", "SRC", "-o", "OUT", "--quantize", "int8")
    assert build(ExportOptions, kw, skip=("load.dtype",)).quantize == "int8"


def test_load_options_take_every_dtype_name():
    assert [LoadOptions(dtype=n).dtype for n in ("bf16", "float16", torch.float32, None)] == \
        ["bfloat16", "float16", "float32", None]
    with pytest.raises(NormswapError, match="unknown dtype 'fp8'"):
        LoadOptions(dtype="fp8")
