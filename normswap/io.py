"""Loading models from a SRC (folder, Hub id, `normswap-demo`) and saving/loading converted ones.

Converted models are saved in Hugging Face layout: config.json (with a `normswap` section that
records every converted norm and added bias), model.safetensors, tokenizer files. Loading never
unpickles. Every write goes to a temporary folder renamed into place at the end.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
from pathlib import Path

import torch
import transformers
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

from normswap.demo import DEMO_DIR, DEMO_NAME
from normswap import shards
from normswap.errors import NormswapError
from normswap.norms import build_norm
from normswap.surgery.centring import apply_output_fixes
from normswap.surgery.walk import ensure_bias, replace_module

WEIGHTS = "model.safetensors"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def is_causal_lm(model_or_config) -> bool:
    """True for a causal LM: its class or config.architectures ends in ...ForCausalLM / ...LMHeadModel."""
    config = getattr(model_or_config, "config", model_or_config)
    names = list(getattr(config, "architectures", None) or [])
    if isinstance(model_or_config, nn.Module):
        names.append(type(model_or_config).__name__)
    return any(n.endswith(("ForCausalLM", "LMHeadModel")) for n in names)


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


def load_model(src: str, dtype: str | None = None):
    """(model, tokenizer or None) from a folder, a Hub id or `normswap-demo`; in eval mode.

    dtype: "float32" | "float16" | "bfloat16" | None (as stored; the demo model loads in float32).
    """
    where, local = resolve_source(src)
    if dtype is not None and dtype not in DTYPES:
        raise NormswapError(f"unknown dtype '{dtype}': choose one of {', '.join(DTYPES)}")
    if src == DEMO_NAME and dtype is None:
        dtype = "float32"
    try:
        config = AutoConfig.from_pretrained(where, local_files_only=local)
        if getattr(config, "normswap", None):
            model = from_pretrained(where, dtype=dtype)
        else:
            cls = AutoModelForCausalLM if is_causal_lm(config) else AutoModel
            model = cls.from_pretrained(where, local_files_only=local,
                                        dtype=DTYPES[dtype] if dtype else "auto")
    except NormswapError:
        raise
    except Exception as e:  # transformers raises many types; users get one line
        raise NormswapError(f"cannot load model from {src}: {str(e).splitlines()[0]}") from None
    return model.eval(), load_tokenizer(where, local)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model",
                   "spiece.model")


def load_tokenizer(where: str, local: bool = True):
    """The model's tokenizer, or None when it has none (transformers 5 would build an empty one)."""
    if local and not any((Path(where) / f).exists() for f in TOKENIZER_FILES):
        return None
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, local_files_only=local)
    except Exception:
        return None
    return tokenizer if len(tokenizer) > 0 else None


@contextlib.contextmanager
def atomic_dir(out: str | Path, overwrite: bool = False):
    """Yield a temp folder beside `out`; on success it replaces `out`, on failure it is removed."""
    out = Path(out).expanduser()
    if out.exists() and not overwrite:
        raise NormswapError(f"{out} exists: pass --overwrite to replace it")
    if out.exists() and not out.is_dir():
        raise NormswapError(f"{out} exists and is not a folder")
    parent = out.parent if str(out.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f".{out.name}.tmp-"))
    except OSError as e:
        raise NormswapError(f"cannot write to {parent}: {e.strerror}") from None
    try:
        yield tmp
        if out.exists():
            old = Path(tempfile.mkdtemp(dir=parent, prefix=f".{out.name}.old-"))
            os.replace(out, old / "x")
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_pretrained(model: nn.Module, out: str | Path, tokenizer=None, overwrite: bool = False,
                    max_shard_size: int | str = shards.DEFAULT_MAX_SHARD_SIZE, check=None) -> Path:
    """Save a (converted) HF model to `out` as config.json + model.safetensors, sharded with an index above
    max_shard_size (e.g. "5GB"), + tokenizer. check(folder), if given, runs on the written folder before
    it replaces `out`; raising aborts the save."""
    if not hasattr(model, "config"):
        raise NormswapError("save_pretrained needs a Hugging Face model (with .config)")
    model.config.architectures = [type(model).__name__]  # what from_pretrained rebuilds (as HF does)
    model.config.dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    with atomic_dir(out, overwrite) as tmp:
        model.config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None and is_causal_lm(model.config):
            with contextlib.suppress(Exception):
                model.generation_config.save_pretrained(tmp)
        shards.save_model(model, tmp, max_shard_size)  # tied tensors saved once, restored by loading
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if check is not None:
            check(tmp)
    return Path(out)


def apply_structure(model: nn.Module, section: dict) -> None:
    """Recreate the module changes recorded in a config's `normswap` section (norms, biases, output fixes)."""
    for name, spec in section.get("norms", {}).items():
        replace_module(model, name, build_norm(spec, like=model.get_submodule(name)))
    for name in section.get("added_biases", []):
        ensure_bias(model.get_submodule(name))
    apply_output_fixes(model, section.get("output_fixes", {}))  # after the norms: fixes may sit on them


def from_pretrained(path: str | Path, dtype: str | None = None) -> nn.Module:
    """Rebuild a model saved by `save_pretrained` and load its weights (safetensors, sharded or not)."""
    path = Path(path)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    section = getattr(config, "normswap", None)
    if not section:
        raise NormswapError(f"{path} was not saved by normswap (no 'normswap' section in config.json)")
    arch = (config.architectures or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        raise NormswapError(f"{path}: unknown architecture {arch!r} in config.json")
    stored = DTYPES.get(str(getattr(config, "dtype", None) or "float32").replace("torch.", ""), torch.float32)
    model = cls(config).to(DTYPES[dtype] if dtype else stored)
    apply_structure(model, section)
    shards.load_model(model, path)  # model.safetensors or sharded with an index
    return model.eval()


def read_config(path: str | Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())
