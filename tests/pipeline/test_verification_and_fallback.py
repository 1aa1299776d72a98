"""Streamed and in memory, an exact conversion is one interpreter's result (`ExactResult`), verified under one
rule (enforced for RMSNorm; measured, with a warning, for pRMSNorm), and a conversion that fails verification
after its edits falls back to naive under `auto` the same way, with the same warning."""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from normswap.errors import FellBackToNaive
from normswap.models.load import LoadOptions
from normswap.pipeline import ConvertOptions, convert_checkpoint
from normswap.surgery import verification
from normswap.surgery.exact import fell_back
from normswap.surgery.interpret import ExactResult, Recorder

from helpers.cli import run
from helpers.tiny import tiny_model

STREAMED = ConvertOptions(method="auto", device="cpu")   # a local safetensors folder on the CPU: streamed
IN_MEMORY = dataclasses.replace(STREAMED, load=LoadOptions(allow_missing_weights=True))   # the same, not streamed


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    path = tmp_path_factory.mktemp("one-rule") / "gpt2-fp16"
    tiny_model("gpt2", dtype=torch.float16).save_pretrained(path)
    return path


@pytest.mark.parametrize("to", ["rmsnorm", "prmsnorm"])
def test_streamed_and_in_memory_share_the_result_type_and_the_verification_rule(src, tmp_path, monkeypatch, to):
    seen: list[ExactResult] = []
    real = ExactResult.after_swap

    def after_swap(self, model, report):
        seen.append(self)
        real(self, model, report)
    monkeypatch.setattr(ExactResult, "after_swap", after_swap)
    results = [convert_checkpoint(str(src), tmp_path / name, dataclasses.replace(o, method="exact", to=to))
               for name, o in (("streamed", STREAMED), ("in-memory", IN_MEMORY))]
    assert [r.streamed for r in results] == [True, False]
    assert [isinstance(r.edits, Recorder) for r in seen] == [True, False]   # recorded for the writer; made
    for r in results:
        assert r.report.method == "exact"
        assert r.report.verification["enforced"] is (to == "rmsnorm")
        assert r.report.warnings.count(verification.PARTIAL_WARNING) == (to == "prmsnorm")
    assert results[0].report.warnings == results[1].report.warnings


def test_a_failed_verification_falls_back_to_naive_alike_streamed_and_in_memory(src, tmp_path, monkeypatch):
    # fails once the weights are edited; the rehearsal before any edit (in fp32) still passes
    monkeypatch.setitem(verification.TOLERANCE, torch.float16, -1.0)
    tail = fell_back("").partition(";")[2]
    for name, o in (("streamed", STREAMED), ("in-memory", IN_MEMORY)):
        with pytest.raises(verification.VerificationFailed, match=r"max relative .* > -1 \(float16\); nothing was"):
            convert_checkpoint(str(src), tmp_path / f"{name}-exact", dataclasses.replace(o, method="exact"))
        with pytest.warns(FellBackToNaive):
            result = convert_checkpoint(str(src), tmp_path / name, o)
        assert result.streamed is (o is STREAMED) and result.report.method == "naive"
        assert result.report.warnings[-1].startswith("no exact conversion: exact conversion failed verification: "
                                                     "max relative ")
        assert result.report.warnings[-1].endswith(tail) and result.report.warnings.count(
            result.report.warnings[-1]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in-memory", "streamed"]


def test_each_fallback_is_one_python_warning_and_one_cli_line(src, tmp_path, monkeypatch):
    """Issue 46 #5: `auto`'s fallback was only in the report; now also a `FellBackToNaive` warning, once per
    fallback, streamed and in memory; the CLI, which prints the report's warnings, prints it once."""
    monkeypatch.setitem(verification.TOLERANCE, torch.float16, -1.0)
    for name, o in (("streamed", STREAMED), ("in-memory", IN_MEMORY)):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            result = convert_checkpoint(str(src), tmp_path / name, o)
        fell = [str(w.message) for w in seen if issubclass(w.category, FellBackToNaive)]
        assert fell == [result.report.warnings[-1]] and result.report.method == "naive"
    r = run("convert", src, "--to", "rmsnorm", "-o", tmp_path / "cli", "--json")
    assert r.exit_code == 0 and r.stderr.count("fell back to naive") == 1, r.stderr
