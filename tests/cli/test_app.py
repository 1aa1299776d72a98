"""Issue 33 (20, 21): every error is one line, whatever the message holds (newlines and terminal escapes from a
file's names are shown escaped); an out-of-memory error with no message still says what happened. Issue 47: any
other exception is a bug, said so ("internal error: ...", with the way to its traceback)."""
from __future__ import annotations

import pytest
import torch

from normswap.cli import convert as convert_cli
from normswap.errors import NormswapError, printable
from normswap.surgery.report import ConversionReport

from helpers.cli import one_error_line, run


HINT = " (run with -v for the traceback)"


@pytest.mark.parametrize("exc,line", [
    (MemoryError(), "error: MemoryError: out of memory"),
    (OSError(28, "No space left on device"), "error: OSError: [Errno 28] No space left on device"),
    (torch.OutOfMemoryError("CUDA out of memory"), "error: OutOfMemoryError: CUDA out of memory"),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory"),   # torch's CPU
     "error: RuntimeError: [enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory"),
    (IndexError(), "internal error: IndexError: (no message)" + HINT),   # a bug of normswap's (issue 47)
    (NormswapError("tensor a\nb\x1b[31m is odd"), "error: tensor a\\x0ab\\x1b[31m is odd"),
    (RuntimeError("\n\nbad\x9b2J\nmore"), "internal error: RuntimeError: bad\\x9b2J" + HINT)])
def test_errors_are_one_line_whatever_the_message(monkeypatch, exc, line):
    def fail(*a, **k):
        raise exc
    monkeypatch.setattr(convert_cli.verbs, "inspect", fail)
    r = run("inspect", "normswap-demo")
    assert r.exit_code == 1 and r.output.strip().splitlines() == [line], r.output


def test_report_lines_show_names_escaped():
    report = ConversionReport(to="rmsnorm", method="naive", not_preserved={"h\x1b[2J": "changed\nfake line"})
    assert report.to_table().splitlines()[-1] == "not preserved: h\\x1b[2J: changed\\x0afake line"
    assert printable("tab\there ok é") == "tab\\x09here ok é"


def test_an_error_stays_one_line_when_naming_its_flags_runs_out_of_memory(monkeypatch):
    """Issue 33 #21: under an address-space limit, the import of every command's module (to spell flags as the
    command line does) raised MemoryError while an error was being reported: a traceback."""
    from normswap.cli.app import Group

    def fail(*a, **k):
        raise NormswapError("cannot load model from x: Cannot allocate memory (os error 12)")

    def no_memory(self):
        raise MemoryError()
    monkeypatch.setattr(convert_cli.verbs, "inspect", fail)
    monkeypatch.setattr(Group, "flag_names", no_memory)
    assert one_error_line(run("inspect", "normswap-demo")) == \
        "error: cannot load model from x: Cannot allocate memory (os error 12)"

