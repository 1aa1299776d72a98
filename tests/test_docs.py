"""The README and the documentation pages (docs/) work as written (issue 47 #6): every `normswap ...` line parses
against the real command line, every folder a command reads was written before it on its page, every ```python
block runs (page by page, in a scratch folder, on the demo and tiny models), and every relative link names a file
that exists (mkdocs' strict build checks the links between pages and their anchors; not the README's)."""
from __future__ import annotations

import re
import shlex
import shutil
import unicodedata
from pathlib import Path

import click
import pytest
import torch

from normswap.cli import main

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
MAKE_DEMO_OUT = re.search(r"^DEMO_OUT \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
# What a page may read without writing it: the bundled model, the folder `make demo` writes, the user's own
# model folder (the python blocks get the demo model saved by transformers there) and text files
GIVEN = {"normswap-demo", MAKE_DEMO_OUT, "gpt2-folder", "llama-folder"}   # the last two: a user's own folders
READS = {"convert", "heal", "export", "eval", "inspect", "generate", "rotate", "plot"}   # verb SRC ...
NEEDS = re.compile(r"#\s*needs:\s*(hub|gpu)\b")   # a python block's first line: the tests skip it


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def blocks(page: Path, lang: str) -> list[str]:
    """The fenced ```lang blocks of a page, in order, de-indented (a block inside a list item)."""
    found = re.findall(rf"^( *)```{lang}\n(.*?)^\1```", page.read_text(), re.M | re.S)
    return ["\n".join(line[len(indent):] for line in body.splitlines()) for indent, body in found]


def commands(page: Path) -> list[list[str]]:
    """Every `normswap ...` line (and `... -m normswap ...` under a launcher) of a page's bash blocks, its
    continuation lines joined and its comment dropped, as the arguments after `normswap`."""
    found = []
    for block in blocks(page, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["normswap"]:
                found.append(words[1:])
            elif "-m" in words and words[words.index("-m") + 1:][:1] == ["normswap"]:
                found.append(words[words.index("-m") + 2:])
    return found


def parse(args: list[str]) -> click.Context:
    """The context click builds for `normswap ARGS` (UsageError on an unknown option or a bad choice); `...`
    stands for arguments left out, so a missing one is no error there."""
    while args and args[0] in ("-q", "-v", "--quiet", "--verbose"):
        args = args[1:]
    command = main.get_command(None, args[0])
    assert command is not None, f"no command {args[0]!r}"
    rest = [a for a in args[1:] if a != "..."]
    try:
        return command.make_context(args[0], rest)
    except click.MissingParameter:
        if "..." not in args:
            raise


EVERY_COMMAND = [(page_id(p), c) for p in PAGES for c in commands(p)]


@pytest.mark.parametrize("page, args", EVERY_COMMAND, ids=[f"{p}:{' '.join(c)[:60]}" for p, c in EVERY_COMMAND])
def test_every_command_line_parses(page, args):
    """A flag the command does not have, or a choice it does not offer, fails click's parse as it would fail the
    user; `--version` and `--help` lines are checked by name."""
    if args and args[0] in ("--version", "--help", "-h"):
        return
    parse(args)


def test_the_pages_show_every_command():
    shown = {c[0] for _, c in EVERY_COMMAND if c and not c[0].startswith("-")}
    assert shown == set(main.list_commands(None))


def _out(args: list[str]) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a in ("-o", "--output", "--onnx")]


@pytest.mark.parametrize("page", [page_id(p) for p in PAGES if commands(p)])
def test_every_folder_a_command_reads_was_written_before_it(page):
    """The export examples read `demo-rms`, written only by the block's last line; `make demo` writes
    demo-rmsnorm. Each page counts alone: a reader may start on any page."""
    written = set(GIVEN)
    for args in commands(ROOT / page):
        if not args or args[0] not in READS:
            continue
        reads = [args[1]] if len(args) > 1 and not args[1].startswith("-") else []
        reads += [args[i + 1] for i, a in enumerate(args[:-1]) if a in ("--teacher", "--reference")]
        for src in reads:
            assert src == "..." or src.rstrip("/") in written, (page, args, written)
        written.update(o.rstrip("/") for o in _out(args))


def _slug(heading: str) -> str:
    """The anchor Python-Markdown's toc (mkdocs) and GitHub give a heading: markup dropped, lower case, words
    joined by hyphens."""
    text = re.sub(r"[`*]|\[([^]]*)\]\([^)]*\)", r"\1", heading)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


LINK = re.compile(r"(?<!!)\[[^]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", [page_id(p) for p in PAGES])
def test_every_relative_link_names_a_file_that_exists(page):
    """mkdocs --strict sees only links between pages; the README's links into docs/ and benchmarks/ it never
    reads, and a page linking outside docs/ would only warn there."""
    path = ROOT / page
    text = re.sub(r"^ *```.*?^ *```|`[^`\n]*`", "", path.read_text(), flags=re.M | re.S)
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue   # https:, mailto:
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        assert linked.exists(), f"{page}: {target} does not exist"
        if page != "README.md":
            assert DOCS in linked.parents, f"{page}: {target} is outside docs/ (not in the site)"
        if anchor and linked.suffix == ".md":
            assert anchor in _anchors(linked), f"{page}: {target}: no heading gives #{anchor}"


def test_every_page_is_in_the_site_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    assert {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")} == set(re.findall(r":\s*(\S+\.md)$", nav, re.M))


# ---- the python blocks ----

PYTHON_PAGES = [p for p in PAGES if blocks(p, "python")]


def test_few_blocks_are_left_out():
    """A block that needs the Hub or a GPU says so in its first line and is skipped: there should be few."""
    marked = [(page_id(p), b.splitlines()[0]) for p in PYTHON_PAGES for b in blocks(p, "python") if NEEDS.match(b)]
    assert len(marked) <= 2, marked


@pytest.fixture(scope="module")
def given(tmp_path_factory):
    """The folders and files the pages name as given: the demo model saved by transformers (`gpt2-folder/`, the
    user's own model), a tiny Llama (`llama-folder/`: a model that is RMSNorm already), the folder `make demo`
    writes, and a text (`my.txt`, `held.txt`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import normswap

    root = tmp_path_factory.mktemp("given")
    model, tokenizer = normswap.load_model("normswap-demo")
    model.save_pretrained(root / "gpt2-folder")
    tokenizer.save_pretrained(root / "gpt2-folder")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
                     ).save_pretrained(root / "llama-folder")
    tokenizer.save_pretrained(root / "llama-folder")
    normswap.convert_checkpoint("normswap-demo", root / MAKE_DEMO_OUT, normswap.ConvertOptions(to="rmsnorm"))
    text = (Path(normswap.__file__).parent / "demo" / "heal.txt").read_text()
    for name in ("my.txt", "held.txt"):
        (root / name).write_text(text[: len(text) // 4])
    return root


@pytest.mark.slow
@pytest.mark.parametrize("page", [page_id(p) for p in PYTHON_PAGES])
def test_every_python_block_runs(page, given, tmp_path, monkeypatch):
    """Each page's blocks run in order in one namespace, in a scratch folder holding what the pages name as given
    (`GPT` is the hand-written model of tests/helpers/user_models.py, the user's own class)."""
    from helpers.user_models import GPT

    shutil.copytree(given, tmp_path, dirs_exist_ok=True)
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__docs__", "GPT": GPT}
    for n, block in enumerate(blocks(ROOT / page, "python")):
        if NEEDS.match(block):
            continue
        exec(compile(block, f"{page} (python block {n + 1})", "exec"), namespace)
