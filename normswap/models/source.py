"""Reading a SRC before any model is built: where it is (folder, Hub id, `normswap-demo`), its config.json,
the transformers class that loads it, and whether its weights match that class."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
from pathlib import Path

import torch
import transformers
from transformers import (AutoModel, AutoModelForCausalLM, AutoModelForCTC, AutoModelForImageClassification,
                          AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq)

from normswap.errors import NormswapError
from normswap.models.demo import DEMO_DIR, DEMO_NAME
from normswap.models.introspect import is_causal_lm

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def dtype_name(dtype) -> str | None:
    """A key of DTYPES for `dtype` given as one, as fp32/fp16/bf16, "torch.float16" or a torch.dtype."""
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    name = ALIASES.get(name, name)
    if name not in DTYPES:
        raise NormswapError(f"unknown `dtype` {dtype!r}: choose float32, float16 or bfloat16 (fp32, fp16, bf16)")
    return name


def transformers_class(name: str):
    """The model class transformers itself defines under `name` (never code from a folder), else None."""
    cls = getattr(transformers, name, None) if name.isidentifier() and not name.startswith("_") else None
    return cls if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel) else None


def auto_class(config):
    """The class that loads config.architectures' head: the transformers class it names (built in, for this
    config: never the folder's own code), else the Auto class for its kind (causal LM, (speech) seq2seq,
    image classifier, CTC), else AutoModel (no head)."""
    for name in getattr(config, "architectures", None) or []:
        cls = transformers_class(name)
        if cls is not None and isinstance(getattr(cls, "config_class", None), type) and \
                isinstance(config, cls.config_class):
            return cls
    if is_causal_lm(config):
        return AutoModelForCausalLM
    names = list(getattr(config, "architectures", None) or [])
    candidates = {"ForConditionalGeneration": (AutoModelForSpeechSeq2Seq, AutoModelForSeq2SeqLM),
                  "ForImageClassification": (AutoModelForImageClassification,), "ForCTC": (AutoModelForCTC,)}
    for suffix, classes in candidates.items():
        if any(n.endswith(suffix) for n in names):
            for cls in classes:
                if type(config) in cls._model_mapping:
                    return cls
    return AutoModel


def _hub_reachable(timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false"):
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def resolve_source(src: str) -> tuple[str, bool]:
    """(path or hub id, is_local). Raises for missing paths and an unreachable Hub."""
    if src == DEMO_NAME:
        return str(DEMO_DIR), True
    path = Path(src).expanduser()
    if path.exists():
        if not path.is_dir():
            raise NormswapError(f"{src} is a file: pass a model folder (config.json + weights)")
        if not (path / "config.json").exists():
            raise NormswapError(f"{src} has no config.json: not a model folder")
        return str(path), True
    looks_like_path = src.startswith((".", "/", "~")) or src.count("/") > 1 or os.sep in src[:1]
    if looks_like_path:
        raise NormswapError(f"no such folder: {src}")
    with contextlib.suppress(Exception):  # already in the local Hub cache: no network needed
        from huggingface_hub import try_to_load_from_cache
        if isinstance(try_to_load_from_cache(src, "config.json"), str):
            return src, False
    if not _hub_reachable():
        raise NormswapError(f"offline: cannot reach the Hugging Face Hub to fetch '{src}'; "
                            "pass a local folder (or normswap-demo)")
    return src, False


def read_config(path: str | Path) -> dict:
    """config.json as a dict; one clear error when it is missing or not a JSON object."""
    file = Path(path) / "config.json"
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise NormswapError(f"{path} has no config.json: not a model folder") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise NormswapError(f"{file} is not readable JSON: {str(e).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise NormswapError(f"{file} is not a JSON object")
    return raw


def _names(keys, limit: int = 5) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:limit]) + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def check_weights(src, missing, unexpected, mismatched, allow: bool) -> None:
    """One line naming every tensor the weights file lacks, has extra, or has in the wrong shape; a warning
    on stderr instead of an error when `allow`."""
    parts = [f"{len(missing)} missing ({_names(missing)})"] if missing else []
    parts += [f"{len(unexpected)} unexpected ({_names(unexpected)})"] if unexpected else []
    if mismatched:
        shapes = [f"{k} {tuple(a)} in the file, {tuple(b)} in the model" for k, a, b in sorted(mismatched)]
        parts.append(f"{len(mismatched)} of the wrong shape ({_names(shapes, 3)})")
    if not parts:
        return
    msg = f"{src}: the weights do not match the config: {'; '.join(parts)}"
    if not allow:
        raise NormswapError(msg + "; pass `allow_missing_weights=True` to load anyway (missing and wrong-shaped "
                                  "tensors get random values, unexpected ones are dropped)")
    print(f"warning: {msg}: loading anyway (allow_missing_weights)", file=sys.stderr)
