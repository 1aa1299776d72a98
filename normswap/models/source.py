"""Reading a SRC before any model is built: where it is (folder, Hub id, `normswap-demo`), its config.json,
the transformers class that loads it, and whether its weights match that class."""
from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from huggingface_hub.utils import HFValidationError, validate_repo_id
from transformers import (AutoModel, AutoModelForCausalLM, AutoModelForCTC, AutoModelForImageClassification,
                          AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq)

from normswap.io import safetensors
from normswap.errors import NormswapError, first_line
from normswap.models.demo import DEMO_DIR, DEMO_NAME
from normswap.models.introspect import is_causal_lm

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
DTYPE_NAMES = {**ALIASES, **{name: name for name in DTYPES}}   # every name `dtype` takes -> a DTYPES key


def dtype_name(dtype) -> str | None:
    """A key of DTYPES for `dtype` given as one, as fp32/fp16/bf16, "torch.float16" or a torch.dtype."""
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    name = DTYPE_NAMES.get(name)
    if name is None:
        raise NormswapError(f"unknown `dtype` {dtype!r}: choose float32, float16 or bfloat16 (fp32, fp16, bf16)")
    return name


def transformers_class(name: str):
    """The model class transformers itself defines under `name` (never code from a folder), else None."""
    cls = getattr(transformers, name, None) if name.isidentifier() and not name.startswith("_") else None
    return cls if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel) else None


def model_code(config: dict) -> dict[str, str]:
    """The entries of config.json's `auto_map` that name the folder's own config or model classes."""
    auto_map = config.get("auto_map") if isinstance(config, dict) else None
    return {k: v for k, v in auto_map.items() if k == "AutoConfig" or k.startswith("AutoModel")} \
        if isinstance(auto_map, dict) else {}


def check_code(src: str, config: dict, trust_remote_code: bool, converting: bool) -> None:
    """Refuse a SRC folder that ships its own model code (auto_map) unless `trust_remote_code`, even when its
    model_type is also one transformers knows (which class would the folder's owner mean?); and, when
    `converting`, refuse it in any case: a converted folder must rebuild exactly without code normswap did
    not write (its modeling_normswap.py derives from transformers' own classes only). normswap's own folders
    are rebuilt from the section's `base` and never run their auto_map."""
    code = model_code(config)
    if not code or config.get("normswap"):
        return
    names = ", ".join(f"{k} -> {v}" for k, v in sorted(code.items()))
    if converting:
        raise NormswapError(f"cannot convert {src}: it ships its own model code (auto_map: {names}); normswap "
                            "converts only transformers' own model classes, whose converted folder it can rebuild "
                            "exactly, in normswap and in plain transformers")
    if not trust_remote_code:
        raise NormswapError(f"cannot load model from {src}: it ships its own Python code (auto_map: {names}), which "
                            "normswap runs only with `trust_remote_code=True`")


def auto_class(config):
    """The class that loads config.architectures' head: the transformers class it names (built in, for this
    config: never the folder's own code, unless the config comes from it), else the Auto class for its kind
    (causal LM, (speech) seq2seq, image classifier, CTC), else AutoModel (no head)."""
    own_code = model_code(config.to_dict()) if hasattr(config, "to_dict") else {}
    for name in [] if own_code else getattr(config, "architectures", None) or []:
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


def build_model(cls, config, dtype: torch.dtype):
    """`cls` (a model or Auto class) built from `config` in `dtype` as transformers' from_pretrained builds it:
    tensors made in the default dtype take `dtype`, those made in another keep it, and those the class keeps
    in float32 (`_keep_in_fp32_modules` for float16, `_keep_in_fp32_modules_strict` for 16-bit) are float32."""
    make = cls.from_config if hasattr(cls, "from_config") else cls._from_config   # an Auto class, or a model
    model = make(config, dtype=dtype)
    plan = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
    if plan:
        from transformers.core_model_loading import build_glob_alternation   # transformers' own matching
        pattern, groups, _ = build_glob_alternation(list(plan))
        for name, t in model.state_dict(keep_vars=True).items():
            found = pattern.search(name)
            if found and t.is_floating_point() and t.dtype != plan[groups[found.lastgroup]]:
                owner, _, attr = name.rpartition(".")
                if isinstance(t, torch.nn.Parameter):
                    t.data = t.data.to(plan[groups[found.lastgroup]])
                else:
                    model.get_submodule(owner)._buffers[attr] = t.to(plan[groups[found.lastgroup]])
    return model


def _hub_reachable(timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false"):
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _looks_like_path(src: str) -> bool:
    """Whether `src`, which does not exist on disk, cannot be a Hub id (`name` or `org/name`): a folder's
    path (`./x`, `/x`, `~/x`, `a/b/c`, `demo-rms/`, a name with spaces), so it is a missing folder."""
    if src.startswith((".", "/", "~")) or os.sep in src[:1]:
        return True
    try:
        validate_repo_id(src)
    except HFValidationError:
        return True
    return False


def resolve_source(src: str) -> tuple[str, bool]:
    """(path or hub id, is_local). Raises for missing paths, a folder holding a PEFT adapter (refused by every
    command alike) and an unreachable Hub."""
    if src == DEMO_NAME:
        return str(DEMO_DIR), True
    path = Path(src).expanduser()
    if path.exists():
        if not path.is_dir():
            raise NormswapError(f"{src} is a file: pass a model folder (config.json + weights)")
        if (path / "adapter_config.json").exists():   # transformers would apply it on some loads, not others
            raise NormswapError(f"{src} holds a PEFT adapter (adapter_config.json): merge it into its base model "
                                "(peft's merge_and_unload, then save_pretrained) and pass that folder")
        if not (path / "config.json").exists():
            raise NormswapError(f"{src} has no config.json: not a model folder")
        return str(path), True
    if _looks_like_path(src):
        raise NormswapError(f"no such folder: {src}")
    with contextlib.suppress(Exception):  # already in the local Hub cache: no network needed
        from huggingface_hub import try_to_load_from_cache
        if isinstance(try_to_load_from_cache(src, "config.json"), str):
            return src, False
    if not _hub_reachable():
        raise NormswapError(f"offline: cannot reach the Hugging Face Hub to fetch '{src}'; "
                            "pass a local folder (or normswap-demo)")
    return src, False


def source_folder(src: str) -> Path | None:
    """The local folder SRC's files are in (a folder, the demo, or the Hub cache's snapshot), else None."""
    where, local = resolve_source(src)
    if local:
        return Path(where)
    with contextlib.suppress(Exception):
        from huggingface_hub import try_to_load_from_cache
        found = try_to_load_from_cache(src, "config.json")
        return Path(found).parent if isinstance(found, str) else None
    return None


def read_config(path: str | Path) -> dict:
    """config.json as a dict; one clear error when it is missing or not a JSON object."""
    file = Path(path) / "config.json"
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise NormswapError(f"{path} has no config.json: not a model folder") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise NormswapError(f"{file} is not readable JSON: {first_line(e)}") from None
    if not isinstance(raw, dict):
        raise NormswapError(f"{file} is not a JSON object")
    return raw


def weights_reader(src: str, where: str | Path, mapped: bool = False) -> safetensors.Reader:
    """The tensors of folder `where` as transformers would load them (headers validated before any is read);
    an error names the SRC that cannot load."""
    try:
        return safetensors.Reader(where, mapped)
    except NormswapError as e:
        raise NormswapError(f"cannot load model from {src}: {e}") from None


@dataclass(frozen=True)
class Source:
    """A SRC resolved once: `text` as given (for messages), `where` it is (a folder or a Hub id) and, for a local
    folder, its config.json (`read_config`)."""
    text: str
    where: str
    local: bool
    config: dict | None


def read_source(src: str) -> Source:
    """`src` resolved (`resolve_source`) and, when it is a local folder, its config.json read."""
    where, local = resolve_source(src)
    return Source(src, where, local, read_config(where) if local else None)


@dataclass(frozen=True)
class Folder:
    """A local checkpoint folder read once for a lazy conversion and its verification: `src` (its path, for messages),
    config.json and the weights transformers would load (`weights_reader`, mapped)."""
    src: str
    path: Path
    config: dict
    reader: safetensors.Reader


def read_folder(path: str | Path, config: dict | None = None) -> Folder:
    """Folder `path` (its config.json read unless given), refused when it ships its own model code
    (`check_code`), with its weights' headers validated."""
    path = Path(path)
    config = read_config(path) if config is None else config
    check_code(str(path), config, trust_remote_code=False, converting=True)
    return Folder(str(path), path, config, weights_reader(str(path), path, mapped=True))


def load_dtype(src: str, config, reader) -> torch.dtype:
    """The dtype a checkpoint loads in when none is asked for: what transformers' dtype="auto" picks, for
    in-memory and lazy conversions alike: config.json's `dtype` (`torch_dtype`), else the index's
    metadata dtype, else the first floating-point tensor (by name) of the first weights file. Every
    floating-point tensor is cast to it; a warning names those the cast loses precision in."""
    chosen = getattr(config, "dtype", None) or reader.index_dtype
    if chosen is None:
        first = reader.files[0]
        chosen = next((d for k, (f, d, *_) in sorted(reader.entries.items()) if f == first and d.is_floating_point
                       and d.itemsize > 1), torch.float32)
    chosen = getattr(torch, str(chosen).replace("torch.", ""), None) if not isinstance(chosen, torch.dtype) else chosen
    if not isinstance(chosen, torch.dtype) or not chosen.is_floating_point:
        raise NormswapError(f"{src}: config.json's dtype {getattr(config, 'dtype', None)!r} is not a torch "
                            "floating-point dtype")
    narrowed = sorted({d for d, _ in map(reader.meta, reader.keys())
                       if d.is_floating_point and d != chosen and d.itemsize >= chosen.itemsize})
    if narrowed:
        named = str(chosen).replace("torch.", "")
        kinds = ", ".join(str(d).replace("torch.", "") for d in narrowed)
        print(f"warning: {src}: tensors stored in {kinds} are loaded in {named} (config.json's dtype, as transformers "
              f"loads them), which rounds them; to keep them, load with dtype='float32' (CLI: --dtype fp32)",
              file=sys.stderr)
    return chosen


def ignored_keys(model, missing, unexpected) -> tuple[list[str], list[str]]:
    """`missing` and `unexpected` tensor names without those transformers does not report when loading `model`
    (as `PreTrainedModel._adjust_missing_and_unexpected_keys`): the class's `_keys_to_ignore_on_load_missing`
    (Marian's sinusoidal positions, made when the model is built) and `_keys_to_ignore_on_load_unexpected`
    patterns, and stale `rotary_emb.inv_freq` / `position_ids` entries where the model has such buffers."""
    buffers = [name for name, _ in model.named_buffers()]
    extra = {r"rotary_emb\.inv_freq"} if any(b.endswith("rotary_emb.inv_freq") for b in buffers) else set()
    extra |= {r"(^|\.)position_ids$"} if any(b.endswith("position_ids") for b in buffers) else set()

    def keep(keys, patterns) -> list[str]:
        found = re.compile("|".join(f"({p})" for p in patterns)) if patterns else None
        return sorted(k for k in keys if found is None or found.search(k) is None)
    return (keep(missing, set(getattr(model, "_keys_to_ignore_on_load_missing", None) or ())),
            keep(unexpected, set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()) | extra))


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
