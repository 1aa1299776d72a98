"""The bundled demo model (`normswap-demo`) and the corpus split it was trained on.

A 4-layer, 256-wide GPT-2 trained on Jane Austen's novels by examples/train_demo_model.py.
Persuasion chapters 21-24 are held out of training; a copy ships as demo/heldout.txt so
perplexity can be measured offline on any machine (`normswap eval`'s default text). Chapters 1-20, from the
training split, ship as demo/heal.txt: text to heal a converted demo on (`--data normswap-demo`) that
never contains the held-out chapters.
"""
from __future__ import annotations

import re
from pathlib import Path

from normswap.io.bundled import DEMO_DIR, DEMO_NAME

__all__ = ["DEMO_DIR", "DEMO_NAME", "HEAL_FILE", "HELDOUT_FILE", "contains_heldout", "heldout_text", "split_corpus"]

HELDOUT_FILE = DEMO_DIR / "heldout.txt"
HEAL_FILE = DEMO_DIR / "heal.txt"   # Persuasion ch. 1-20: training split only
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


def contains_heldout(texts: list[str], probes: int = 8, width: int = 200) -> bool:
    """Whether `texts` hold any of the held-out chapters (a few passages of them, verbatim): training on them
    would leak the text `normswap eval` scores by default."""
    held = heldout_text()
    step = max(1, (len(held) - width) // probes)
    passages = [held[i:i + width] for i in range(0, len(held) - width, step)][:probes]
    return any(p in t for t in texts for p in passages)
