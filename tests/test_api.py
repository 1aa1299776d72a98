"""The public API (`normswap.*`): each verb takes a model or a path and either its options object or keywords,
both only where they agree; the choices are typed and take today's strings; the old names still work, warning."""
from __future__ import annotations

import warnings

import pytest
import torch
from helpers.tiny import tiny_model

import normswap
from normswap import (ConvertOptions, EvaluateOptions, ExportOptions, HealCheckpointOptions, HealOptions,
                      LoadOptions, NormswapError, RotateOptions)
from normswap.choices import options_from
from normswap.pipeline.options import InspectOptions

BOTH = "give options or keywords, not both"


@pytest.fixture(scope="module")
def gpt2():
    return tiny_model("gpt2")


def _one_line(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text
    return text


@pytest.mark.parametrize("call", [
    lambda m: normswap.convert(m, options=ConvertOptions(method="exact"), method="naive"),
    lambda m: normswap.rotate(m, options=RotateOptions(seed=1), seed=2),
    lambda m: normswap.heal(m, None, ["text"], None, HealOptions(steps=3), steps=5),
    lambda m: normswap.evaluate(m, None, ["text"], EvaluateOptions(seq_len=8), seq_len=16),
    lambda m: normswap.export_onnx(m, "a.onnx", ExportOptions(onnx="b.onnx")),
    lambda m: normswap.export_onnx(m, "a.onnx", ExportOptions(dtype="fp16"), dtype="fp32"),
    lambda m: normswap.inspect(m, InspectOptions(device="cpu"), device="cuda"),
], ids=["convert", "rotate", "heal", "evaluate", "export_onnx", "export_onnx-dtype", "inspect"])
def test_every_verb_refuses_options_and_keywords_that_disagree_on_a_model(gpt2, call, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(NormswapError, match=BOTH) as e:
        call(gpt2)
    _one_line(e)


@pytest.mark.parametrize("call", [
    lambda src, out: normswap.convert(src, out, ConvertOptions(method="exact"), method="naive"),
    lambda src, out: normswap.rotate(src, out, RotateOptions(method="random"), method="hadamard"),
    lambda src, out: normswap.heal(src, out, HealCheckpointOptions(teacher=src), teacher="other"),
    lambda src, out: normswap.heal(src, out, HealCheckpointOptions(heal=HealOptions(steps=3)), steps=4),
    lambda src, out: normswap.evaluate(src, EvaluateOptions(batch_size=2), batch_size=4),
    lambda src, out: normswap.export_onnx(src, options=ExportOptions(target="onnx23"), target="ort", out=out),
    lambda src, out: normswap.inspect(src, InspectOptions(load=LoadOptions(dtype="fp16")), dtype="bf16"),
    lambda src, out: normswap.load(src, LoadOptions(trust_remote_code=True), trust_remote_code=False),
], ids=["convert", "rotate", "heal-teacher", "heal-steps", "evaluate", "export_onnx", "inspect", "load"])
def test_every_verb_refuses_options_and_keywords_that_disagree_on_a_path(call, tmp_path):
    with pytest.raises(NormswapError, match=BOTH) as e:
        call("normswap-demo", str(tmp_path / "out"))
    _one_line(e)
    assert not (tmp_path / "out").exists()


def test_options_and_keywords_that_agree_are_one_request():
    given = ConvertOptions(method="exact", load=LoadOptions(dtype="fp16"))
    assert options_from(ConvertOptions, given, {"method": "exact", "dtype": torch.float16}) is given
    assert options_from(LoadOptions, None, {}) == LoadOptions()


def test_keywords_build_the_options_nested_ones_too():
    o = options_from(ConvertOptions, None, {"to": "prmsnorm", "dtype": "fp16", "device": "cpu"})
    assert (o.to, o.load.dtype, o.device) == ("prmsnorm", "float16", "cpu")
    h = options_from(HealCheckpointOptions, None, {"teacher": "t", "steps": 7, "rank": 8})
    assert (h.teacher, h.heal.steps, h.heal.lora.rank) == ("t", 7, 8)
    assert options_from(ExportOptions, None, {"dtype": "float16"}).load == LoadOptions()   # the graph's dtype
    with pytest.raises(NormswapError, match="give load or dtype, not both"):
        options_from(ConvertOptions, None, {"load": LoadOptions(), "dtype": "fp16"})
    with pytest.raises(TypeError, match="unexpected keyword 'methd'"):
        options_from(ConvertOptions, None, {"methd": "exact"})
    with pytest.raises(NormswapError, match="options must be a ConvertOptions, got RotateOptions"):
        options_from(ConvertOptions, RotateOptions(), {})


def test_a_model_in_memory_refuses_what_only_a_path_takes(gpt2):
    with pytest.raises(NormswapError, match="device applies to a path"):
        normswap.convert(gpt2, device="cpu")
    with pytest.raises(NormswapError, match="out is for a path"):
        normswap.convert(gpt2, "out")
    with pytest.raises(NormswapError, match="overwrite applies to a path"):
        normswap.rotate(gpt2, overwrite=True)
    with pytest.raises(NormswapError, match="reference is a model too"):
        normswap.evaluate(gpt2, None, ["text"], reference="normswap-demo")
    with pytest.raises(NormswapError, match="give exactly one of out"):
        normswap.export_onnx(gpt2)
    with pytest.raises(NormswapError, match="a path needs out"):
        normswap.convert("normswap-demo")
    with pytest.raises(NormswapError, match="filter_fn picks the norms of a model in memory"):
        normswap.convert("normswap-demo", "out", filter_fn=lambda m, n: True)


@pytest.mark.parametrize("make, field, given, kept", [
    (RotateOptions, "method", "random", "random"),
    (HealOptions, "train", "lora", "lora"),
    (HealOptions, "objective", "lm", "lm"),
    (ExportOptions, "dtype", "fp16", "fp16"),
    (ExportOptions, "dtype", "float16", "fp16"),
    (ExportOptions, "dtype", torch.float16, "fp16"),
    (ExportOptions, "quantize", "int8", "int8"),
    (LoadOptions, "dtype", "bf16", "bfloat16"),
    (LoadOptions, "dtype", torch.bfloat16, "bfloat16"),
])
def test_typed_choices_take_todays_strings_and_dtypes(make, field, given, kept):
    assert getattr(make(**{field: given}), field) == kept


@pytest.mark.parametrize("make, field, words", [
    (ConvertOptions, "rotate_method", "unknown rotation method 'layernorm': choose hadamard or random"),
    (RotateOptions, "method", "unknown rotation method 'layernorm': choose hadamard or random"),
    (HealOptions, "train", "unknown train mode 'layernorm': choose auto, norms, all or lora"),
    (HealOptions, "objective", "unknown objective 'layernorm': choose kd or lm"),
    (ExportOptions, "dtype", "unknown `dtype` 'layernorm'"),
    (ExportOptions, "quantize", "unknown quantization 'layernorm': choose int8"),
    (LoadOptions, "dtype", "unknown `dtype` 'layernorm'"),
])
def test_typed_choices_refuse_anything_else_in_one_line(make, field, words):
    with pytest.raises(NormswapError) as e:
        make(**{field: "layernorm"})
    assert _one_line(e).startswith(str(NormswapError(words)))


def test_export_onnx_takes_dtype_and_fp16_as_a_deprecated_alias(gpt2, tmp_path):
    from normswap.export.onnx import export_onnx
    path = tmp_path / "m.onnx"
    # each refused before any work: the quantized graph starts from fp32
    with pytest.raises(NormswapError, match="leave out dtype='fp16'"):
        export_onnx(gpt2, path, dtype=torch.float16, quantize="int8")
    with pytest.warns(DeprecationWarning, match="`fp16` is deprecated: use `dtype='fp16'`"), \
            pytest.raises(NormswapError, match="leave out fp16=True"):
        normswap.export_onnx(gpt2, path, fp16=True, quantize="int8")
    with pytest.warns(DeprecationWarning), pytest.raises(NormswapError, match="give dtype or fp16, not both"):
        export_onnx(gpt2, path, dtype="fp16", fp16=False)
    with pytest.raises(NormswapError, match="fp16=True is now dtype='fp16'"):
        export_onnx(gpt2, path, "ort", True)
    with pytest.raises(NormswapError, match="cannot export dtype='bf16'"):
        export_onnx(gpt2, path, dtype="bf16")
    assert not path.exists()


def test_the_old_names_still_work_warning_with_the_new_one(gpt2):
    with pytest.warns(DeprecationWarning, match=r"normswap.load_model is deprecated .*: use normswap.load"):
        load_model = normswap.load_model
    assert load_model is normswap.load
    with pytest.warns(DeprecationWarning, match=r"use normswap.surgery.report.ConversionReport"):
        assert normswap.ConversionReport.__name__ == "ConversionReport"
    with pytest.warns(DeprecationWarning, match=r"use normswap.inspect\(src, options\)"):
        inspect_checkpoint = normswap.inspect_checkpoint
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert normswap.inspect(gpt2).to_convert == inspect_checkpoint.__globals__["inspect_model"](gpt2).to_convert
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        normswap.nothing   # noqa: B018
