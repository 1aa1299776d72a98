"""Plain text in, token ids out: reading --data files and cutting text for `heal` and `evaluate`."""
from __future__ import annotations

import re
from pathlib import Path

import torch

from normswap.errors import NormswapError
from normswap.models.demo import DEMO_NAME, HEAL_FILE
from normswap.models.introspect import config_int


def read_texts(paths) -> list[str]:
    """The contents of text files (a folder stands for its *.txt files; `normswap-demo`, where no such file
    exists, for the demo's heal text: its training split, without the held-out chapters); one-line errors
    otherwise."""
    files: list[Path] = []
    for p in map(Path, paths):
        if str(p) == DEMO_NAME and not p.exists():
            files.append(HEAL_FILE)
        elif p.is_dir():
            found = sorted(p.glob("*.txt"))
            if not found:
                raise NormswapError(f"{p} is a folder with no .txt files")
            files += found
        else:
            files.append(p)
    if not files:
        raise NormswapError("no data: name at least one text file (`data`)")
    texts = []
    for f in files:
        if f.exists() and not f.is_file():   # /dev/zero, a pipe: they never end, or end once read
            raise NormswapError(f"{f} is not a regular file: pass plain text files")
        try:
            with open(f, "rb") as file:   # a binary file is refused from its start, not once wholly read
                if _binary(file.read(1 << 16).decode("utf-8", errors="ignore")):
                    raise NormswapError(f"{f} is not text (NUL or control bytes): pass plain text files")
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise NormswapError(f"{f} is not UTF-8 text") from None
        except OSError as e:
            raise NormswapError(f"cannot read {f}: {e.strerror or e}") from None
        if not text.strip():
            raise NormswapError(f"{f} is empty")
        if _binary(text):
            raise NormswapError(f"{f} is not text (NUL or control bytes): pass plain text files")
        texts.append(text)
    return texts


def _binary(text: str) -> bool:
    """NUL anywhere, or more than 1 in 10 characters control codes other than whitespace: not prose."""
    if "\x00" in text:
        return True
    sample = text[:100_000]
    return sum(c < " " and c not in "\t\n\r\f\v" for c in sample) > len(sample) / 10


def joined_ids(tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts tokenized without special tokens, joined by EOS where the tokenizer has one."""
    if tokenizer is None:
        raise NormswapError("no tokenizer: the model folder needs its tokenizer files")
    if isinstance(texts, str):
        texts = [texts]
    sep = [tokenizer.eos_token_id] if getattr(tokenizer, "eos_token_id", None) is not None else []
    ids: list[int] = []
    for text in texts:
        # Long texts are cut into windows later, so the tokenizer's max-length warning does not apply.
        ids += tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"] + sep
    return torch.tensor(ids, dtype=torch.long)


def wrap_special(tokenizer, windows: torch.Tensor) -> torch.Tensor:
    """[CLS] window [SEP] for BERT-style tokenizers (encoders expect them); unchanged otherwise."""
    cls, sep = getattr(tokenizer, "cls_token_id", None), getattr(tokenizer, "sep_token_id", None)
    if cls is None or sep is None:
        return windows
    n = windows.shape[0]
    return torch.cat([torch.full((n, 1), cls), windows, torch.full((n, 1), sep)], dim=1)


def sentences(texts, min_words: int = 4, limit: int | None = None) -> list[str]:
    """Sentences of the texts (split after . ! ?), whitespace collapsed; short fragments dropped."""
    if isinstance(texts, str):
        texts = [texts]
    out = []
    for text in texts:
        for s in re.split(r"(?<=[.!?])\s+|(?<=[.!?][\"'’”])\s+", " ".join(text.split())):
            if len(s.split()) >= min_words:
                out.append(s)
                if limit and len(out) >= limit:
                    return out
    return out


def max_positions(model) -> int | None:
    """The longest input the model's position embeddings allow (None: no limit known)."""
    return config_int(model.config, "positions")
