"""The README's commands work as written on a fresh clone (issue 33 #6, #8, #10): what they install, the folders
they read, and the options they say each command takes."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import click

from normswap.cli import main

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
MAKE_DEMO_OUT = re.search(r"^DEMO_OUT \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)


def _commands() -> list[list[str]]:
    """Every `normswap ...` and `pip install ...` line of the README's bash blocks, split as the shell would."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        for line in block.splitlines():
            line = line.split(" #")[0].strip()
            if line.startswith(("normswap ", "pip install")):
                lines.append(shlex.split(line))
    return lines


def test_normswap_installs_from_the_clone():
    """normswap is not on the registry: `pip install "normswap[onnx]"` failed."""
    installs = [c for c in _commands() if c[:2] == ["pip", "install"] and any("normswap" in a or a.startswith(".")
                                                                              for a in c[2:])]
    assert installs and all("-e" in c and c[c.index("-e") + 1].startswith(".") for c in installs), installs


def test_every_folder_a_command_reads_was_written_before_it():
    """The export examples read `demo-rms`, written only by the block's last line; `make demo` writes
    demo-rmsnorm."""
    written = {"normswap-demo", MAKE_DEMO_OUT, "gpt2-folder/", "out/", "healed/"}   # given, or the user's own
    for c in _commands():
        if c[0] != "normswap" or len(c) < 3:
            continue
        verb, src = c[1], c[2]
        if verb in ("convert", "heal", "export", "eval", "inspect", "generate") and not src.startswith("-"):
            assert src.rstrip("/") in {w.rstrip("/") for w in written} or src == "...", (c, written)
        for flag in ("-o", "--onnx"):
            if flag in c:
                written.add(c[c.index(flag) + 1])


def _flags(name: str) -> dict[str, click.Option]:
    command = main.get_command(None, name)
    return {o: p for p in command.params if isinstance(p, click.Option) for o in p.opts}


def test_the_device_and_dtype_sentence_names_the_commands_that_take_them():
    """"Every command takes --device and --dtype fp32|fp16|bf16" was false (inspect had no --device, plot
    neither, export --dtype fp32|fp16)."""
    said = re.search(r"Every command that loads a model \(([^)]*)\) takes", README).group(1)
    named = {n.strip(" `") for n in said.split(",")}
    with_device = {n for n in main.list_commands(None) if "--device" in _flags(n)}
    assert named == with_device and set(main.list_commands(None)) - named == {"plot"}
    for name in named:
        assert {"fp32", "fp16", "bf16"} <= set(_flags(name)["--dtype"].type.choices), name
