"""The bundled demo model (`normswap-demo`) and the corpus split it was trained on.

A 4-layer, 256-wide GPT-2 trained on Jane Austen's novels by examples/train_demo_model.py.
Persuasion chapters 21-24 are held out of training; a copy ships as demo/heldout.txt so
perplexity can be measured offline on any machine.
"""
from __future__ import annotations

import re
from pathlib import Path

from normswap.io.bundled import DEMO_DIR, DEMO_NAME

__all__ = ["DEMO_DIR", "DEMO_NAME", "HELDOUT_FILE", "heldout_text", "split_corpus"]

HELDOUT_FILE = DEMO_DIR / "heldout.txt"
HELDOUT_NOVEL, HELDOUT_FROM_CHAPTER = "persuasion.txt", 21


def split_corpus(corpus_dir: str | Path) -> tuple[list[str], str]:
    """(training texts, held-out text) of the Austen corpus: Persuasion ch. 21+ is held out."""
    corpus_dir = Path(corpus_dir)
    train, heldout = [], ""
    for path in sorted(corpus_dir.glob("*.txt")):
        text = path.read_text(encoding="utf-8")
        if path.name == HELDOUT_NOVEL:
            cut = re.search(rf"^Chapter {HELDOUT_FROM_CHAPTER}\s*$", text, flags=re.M)
            if cut is None:
                raise ValueError(f"{path}: cannot find Chapter {HELDOUT_FROM_CHAPTER}")
            text, heldout = text[: cut.start()], text[cut.start():]
        train.append(text)
    return train, heldout


def heldout_text() -> str:
    """The held-out text shipped with the package."""
    return HELDOUT_FILE.read_text(encoding="utf-8")
