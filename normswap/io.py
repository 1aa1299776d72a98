"""Loading models from a SRC (folder, Hub id, `normswap-demo`) and saving/loading converted ones.

Converted models are saved in Hugging Face layout: config.json (with a `normswap` section that
records every converted norm and added bias, validated by normswap/schema.py on load), model.safetensors,
tokenizer files. Every write goes to a temporary folder renamed into place at the end.
Loading runs no code from a model folder unless trust_remote_code is given, and refuses weights that
do not match the config unless allow_missing_weights is given (the CLI's two options set LOAD_POLICY).
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from torch import nn
from transformers import (AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForImageClassification,
                          AutoModelForCTC, AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq,
                          AutoTokenizer)

from normswap import schema
from normswap.atomic import atomic_dir  # noqa: F401  (re-exported: io.atomic_dir)
from normswap.demo import DEMO_DIR, DEMO_NAME
from normswap import shards
from normswap.hub import make_self_describing
from normswap.errors import NormswapError
from normswap.norms import build_norm
from normswap.surgery.centring import apply_output_fixes
from normswap.surgery.walk import ensure_bias, replace_module

WEIGHTS = "model.safetensors"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class LoadPolicy:
    """Defaults for load_model/from_pretrained; the CLI's --trust-remote-code/--allow-missing-weights set them."""
    trust_remote_code: bool = False
    allow_missing_weights: bool = False


LOAD_POLICY = LoadPolicy()


def is_causal_lm(model_or_config) -> bool:
    """True for a causal LM: its class or config.architectures ends in ...ForCausalLM / ...LMHeadModel."""
    config = getattr(model_or_config, "config", model_or_config)
    names = list(getattr(config, "architectures", None) or [])
    if isinstance(model_or_config, nn.Module):
        names.append(type(model_or_config).__name__)
    return any(n.endswith(("ForCausalLM", "LMHeadModel")) for n in names)


def auto_class(config):
    """The class that loads config.architectures' head: the transformers class it names (built in, for this
    config: never the folder's own code), else the Auto class for its kind (causal LM, (speech) seq2seq,
    image classifier, CTC), else AutoModel (no head)."""
    for name in getattr(config, "architectures", None) or []:
        cls = _transformers_class(name)
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


def _transformers_class(name: str):
    """The model class transformers itself defines under `name` (never code from a folder), else None."""
    cls = getattr(transformers, name, None) if name.isidentifier() and not name.startswith("_") else None
    return cls if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel) else None


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


def load_model(src: str, dtype: str | None = None, trust_remote_code: bool | None = None,
               allow_missing_weights: bool | None = None):
    """(model, tokenizer or None) from a folder, a Hub id or `normswap-demo`; in eval mode.

    dtype: "float32" | "float16" | "bfloat16" | None (as stored; the demo model loads in float32).
    trust_remote_code: run Python files shipped with the model (auto_map); default LOAD_POLICY's (False).
    allow_missing_weights: load even if tensors are missing, unexpected or of the wrong shape (missing
    ones keep random values); by default that is an error naming them.
    """
    trust = LOAD_POLICY.trust_remote_code if trust_remote_code is None else trust_remote_code
    allow = LOAD_POLICY.allow_missing_weights if allow_missing_weights is None else allow_missing_weights
    where, local = resolve_source(src)
    if dtype is not None and dtype not in DTYPES:
        raise NormswapError(f"unknown dtype '{dtype}': choose one of {', '.join(DTYPES)}")
    if src == DEMO_NAME and dtype is None:
        dtype = "float32"
    if local and "normswap" in read_config(where):  # our own folders: rebuilt without AutoConfig or remote code
        model = from_pretrained(where, dtype=dtype, allow_missing_weights=allow).eval()
        return model, load_tokenizer(where, config=model.config)  # the original config, not normswap_<type>
    try:
        config = AutoConfig.from_pretrained(where, local_files_only=local, trust_remote_code=trust)
        if getattr(config, "normswap", None):
            model = from_pretrained(where, dtype=dtype, allow_missing_weights=allow)
        else:
            model, info = auto_class(config).from_pretrained(
                where, local_files_only=local, trust_remote_code=trust, dtype=DTYPES[dtype] if dtype else "auto",
                output_loading_info=True, ignore_mismatched_sizes=True)
            _check_weights(src, info["missing_keys"], info["unexpected_keys"],
                           [(k, a, b) for k, a, b in info["mismatched_keys"]], allow)
    except NormswapError:
        raise
    except Exception as e:  # transformers raises many types; users get one line
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if not trust and (local and "auto_map" in read_config(where) or "trust_remote_code" in str(e)):
            msg = "it ships its own Python code (auto_map), which normswap runs only with --trust-remote-code"
        raise NormswapError(f"cannot load model from {src}: {msg}") from None
    return model.eval(), load_tokenizer(where, local, trust)


def _names(keys, limit: int = 5) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:limit]) + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def _check_weights(src, missing, unexpected, mismatched, allow: bool) -> None:
    """One line naming every tensor the weights file lacks, has extra, or has in the wrong shape."""
    parts = [f"{len(missing)} missing ({_names(missing)})"] if missing else []
    parts += [f"{len(unexpected)} unexpected ({_names(unexpected)})"] if unexpected else []
    if mismatched:
        shapes = [f"{k} {tuple(a)} in the file, {tuple(b)} in the model" for k, a, b in sorted(mismatched)]
        parts.append(f"{len(mismatched)} of the wrong shape ({_names(shapes, 3)})")
    if not parts:
        return
    msg = f"{src}: the weights do not match the config: {'; '.join(parts)}"
    if not allow:
        raise NormswapError(msg + "; pass --allow-missing-weights to load anyway (missing and wrong-shaped "
                                  "tensors get random values, unexpected ones are dropped)")
    print(f"warning: {msg}: loading anyway (--allow-missing-weights)", file=sys.stderr)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model",
                   "spiece.model")


def load_tokenizer(where: str, local: bool = True, trust_remote_code: bool = False, config=None):
    """The model's tokenizer, or None when it has none (transformers 5 would build an empty one)."""
    if local and not any((Path(where) / f).exists() for f in TOKENIZER_FILES):
        return None
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, local_files_only=local, trust_remote_code=trust_remote_code,
                                                  config=config)
    except Exception:
        return None
    return tokenizer if len(tokenizer) > 0 else None


def save_pretrained(model: nn.Module, out: str | Path, tokenizer=None, overwrite: bool = False,
                    max_shard_size: int | str = shards.DEFAULT_MAX_SHARD_SIZE, check=None) -> Path:
    """Save a (converted) HF model to `out` as config.json + model.safetensors, sharded with an index above
    max_shard_size (e.g. "5GB"), + tokenizer. check(folder), if given, runs on the written folder before
    it replaces `out`; raising aborts the save.

    overwrite: True replaces an empty folder or one normswap wrote; "any" replaces any folder.
    """
    if not hasattr(model, "config"):
        raise NormswapError("save_pretrained needs a Hugging Face model (with .config)")
    model.config.architectures = [type(model).__name__]  # what from_pretrained rebuilds (as HF does)
    model.config.dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    _record_untied(model)
    section = getattr(model.config, "normswap", None)
    with atomic_dir(out, overwrite) as tmp:
        shards.save_model(model, tmp, max_shard_size)  # tied tensors saved once, restored by loading
        if section:  # the class to rebuild (whatever config.json's architectures say) and the checksum
            section.update(format=schema.FORMAT, base={"architecture": type(model).__name__,
                                                       "model_type": model.config.model_type})
            section["checksum"] = schema.checksum(section, tmp)
        model.config.save_pretrained(tmp)
        make_self_describing(tmp, model)  # modeling file + auto_map: loads in transformers without normswap
        if getattr(model, "generation_config", None) is not None and is_causal_lm(model.config):
            with contextlib.suppress(Exception):
                model.generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if check is not None:
            check(tmp)
    return Path(out)


def _record_untied(model: nn.Module) -> None:
    """A config that ties the LM head to the embeddings of a model where they are two tensors (transformers
    unties them when a checkpoint stores both, with different values): saved as is, loading would tie them
    again and the head would become the embedding. The config says what the model is: untied."""
    try:
        inp, head = model.get_input_embeddings(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return
    w_in, w_out = getattr(inp, "weight", None), getattr(head, "weight", None)
    if getattr(model.config, "tie_word_embeddings", False) and w_in is not None and w_out is not None \
            and w_in is not w_out:
        model.config.tie_word_embeddings = False


def apply_structure(model: nn.Module, section: dict) -> None:
    """Recreate the module changes recorded in a config's `normswap` section (norms, biases, output fixes)."""
    for name, spec in section.get("norms", {}).items():
        replace_module(model, name, build_norm(spec, like=model.get_submodule(name)))
    for name in section.get("added_biases", []):
        ensure_bias(model.get_submodule(name))
    apply_output_fixes(model, section.get("output_fixes", {}))  # after the norms: fixes may sit on them


def _base_config(raw: dict, section: dict, where: str):
    """The original architecture's config and model class, as recorded in the section: never remote code."""
    base = section["base"]
    cls = _transformers_class(base["architecture"])
    if cls is None:
        raise NormswapError(f"{where}: unknown architecture {base['architecture']!r} in config.json")
    if base["model_type"] not in transformers.CONFIG_MAPPING:
        raise NormswapError(f"{where}: unknown model_type {base['model_type']!r} in config.json")
    config_cls = transformers.CONFIG_MAPPING[base["model_type"]]
    config = config_cls.from_dict({k: v for k, v in raw.items() if k not in ("auto_map", "model_type")})
    config.architectures = [base["architecture"]]
    return config, cls


def _load_weights(model: nn.Module, path: Path, allow: bool) -> None:
    """Fill `model` from a checkpoint folder (one file or shards), a tensor at a time, naming every missing,
    unexpected or wrong-shaped tensor (tied tensors are stored once, under their first name)."""
    reader = shards.Reader(path)
    alias = shards.aliases(model)
    state = model.state_dict(keep_vars=True)
    stored = set(reader.keys())
    missing = sorted(k for k in state if alias.get(k, k) == k and k not in stored)
    unexpected = sorted(stored - set(state))
    mismatched = [(k, reader.meta(k)[1], list(state[k].shape)) for k in sorted(stored & set(state))
                  if list(reader.meta(k)[1]) != list(state[k].shape)]
    _check_weights(str(path), missing, unexpected, mismatched, allow)
    bad = {k for k, _, _ in mismatched}
    with torch.no_grad():
        for key in reader.keys():
            if key in state and key not in bad:
                state[key].copy_(reader.get(key))


def from_pretrained(path: str | Path, dtype: str | None = None, allow_missing_weights: bool | None = None) -> nn.Module:
    """Rebuild a model saved by `save_pretrained` and load its weights (safetensors only).

    The `normswap` section is validated (normswap/schema.py) and its checksum checked; no code from
    the folder runs (an `auto_map` is ignored: the original architecture is rebuilt).
    """
    allow = LOAD_POLICY.allow_missing_weights if allow_missing_weights is None else allow_missing_weights
    path = Path(path)
    raw = read_config(path)
    section = raw.get("normswap")
    if not section:
        raise NormswapError(f"{path} was not saved by normswap (no 'normswap' section in config.json)")
    schema.validate(section, str(path))
    if not shards.has_weights(path):
        raise NormswapError(f"{path} has no {WEIGHTS} nor {shards.INDEX}")
    schema.verify_checksum(section, path, str(path), header=False)  # the weights: checked by name below
    try:
        config, cls = _base_config(raw, section, str(path))
    except NormswapError:
        raise
    except Exception as e:
        raise NormswapError(f"{path}: bad config.json: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    stored = DTYPES.get(str(getattr(config, "dtype", None) or "float32").replace("torch.", ""), torch.float32)
    model = cls(config).to(DTYPES[dtype] if dtype else stored)
    schema.validate(section, str(path), model)
    apply_structure(model, section)
    _load_weights(model, path, allow)
    schema.verify_checksum(section, path, str(path), header=not allow)
    return model.eval()


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
