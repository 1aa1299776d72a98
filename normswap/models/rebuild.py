"""A folder saved by normswap, rebuilt: the original transformers class from config.json, the recorded
structure (norms, added biases, output and input fixes) applied by `fixes.rebuild` (the code the folder
ships, run here with normswap's own norm modules), the weights loaded. No code from the folder runs (its
`auto_map` is ignored)."""
from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from torch import nn

from normswap.io import safetensors
from normswap.errors import NormswapError, first_line, reraised
from normswap.io import owned
from normswap.folder import portable, schema, fixes
from normswap.models.adopt import adopt
from normswap.folder.modeling import MODELING_FILE
from normswap.models.names import saved_names
from normswap.models.source import (DTYPES, build_model, check_weights, dtype_name, ignored_keys, read_config,
                                    transformers_class)
from normswap.norms import build_norm


def base_config(raw: dict, section: dict, where: str):
    """The original architecture's config and model class, as recorded in the section: never remote code."""
    base = section["base"]
    cls = transformers_class(base["architecture"])
    if cls is None:
        raise NormswapError(f"{where}: unknown architecture {base['architecture']!r} in config.json")
    if base["model_type"] not in transformers.CONFIG_MAPPING:
        raise NormswapError(f"{where}: unknown model_type {base['model_type']!r} in config.json")
    config_cls = transformers.CONFIG_MAPPING[base["model_type"]]
    config = config_cls.from_dict({k: v for k, v in raw.items() if k not in ("auto_map", "model_type")})
    config.architectures = [base["architecture"]]
    return config, cls


def load_weights(model: nn.Module, path: Path, check: Callable[[list, list, list], None]) -> None:
    """Fill `model` from a checkpoint folder (one file or shards), a tensor at a time (a tied tensor is stored
    once, under any of its names). check(missing, unexpected, mismatched: (name, stored shape, model shape))
    runs first and raises to refuse; a wrong-shaped tensor it lets through is left as it is."""
    reader = safetensors.Reader(path)
    alias = safetensors.aliases(model)
    state = model.state_dict(keep_vars=True)
    live = {saved: name for name, saved in saved_names(model).items()}   # as transformers reads its own names
    key = {live.get(k, k): k for k in reader.keys()}
    stored = set(key)
    present = {alias.get(k, k) for k in stored & set(state)}
    missing = [k for k in state if alias.get(k, k) == k and k not in present]
    mismatched = [(k, reader.meta(key[k])[1], list(state[k].shape)) for k in sorted(stored & set(state))
                  if list(reader.meta(key[k])[1]) != list(state[k].shape)]
    check(missing, sorted(stored - set(state)), mismatched)
    bad = {k for k, _, _ in mismatched}
    with torch.no_grad():
        for name, stored_as in key.items():
            if name in state and name not in bad:
                state[name].copy_(reader.get(stored_as))


def _load_weights(model: nn.Module, path: Path, allow: bool) -> None:
    """`load_weights`, naming every missing, unexpected or wrong-shaped tensor (those transformers ignores when
    missing or unexpected are ignored); with `allow`, a warning instead of an error."""
    def check(missing, unexpected, mismatched) -> None:
        missing, unexpected = ignored_keys(model, missing, unexpected)
        check_weights(str(path), missing, unexpected, mismatched, allow)
    load_weights(model, path, check)


def _warn_old_code(path: Path, section: dict) -> None:
    """A folder whose plan has input fixes, saved before its modeling_normswap.py applied them (normswap before
    `portable`): right here, a different model in plain transformers. Said once, with the way out."""
    file = path / MODELING_FILE
    if any(spec.get("input") for spec in section.get("output_fixes", {}).values()) and file.is_file() \
            and "def add_input_fix" not in file.read_text():
        print(f"warning: {path}: its {MODELING_FILE} predates input fixes, so plain transformers "
              "(trust_remote_code=True) would load a different model from it; save it again with normswap "
              "(normswap.save_pretrained) to update that file", file=sys.stderr)


def from_pretrained(path: str | Path, dtype: str | None = None, allow_missing_weights: bool = False,
                    check_fingerprint: bool = True) -> nn.Module:
    """Rebuild a model saved by `save_pretrained` and load its weights (safetensors only).

    The `normswap` section is validated (`schema`) and its checksum checked; no code from the folder runs
    (an `auto_map` is ignored: the original architecture is rebuilt). Once the weights are in, the model must
    reproduce the section's fingerprint (one forward of its probe input; `check_fingerprint=False` or the
    environment's NORMSWAP_NO_FINGERPRINT=1 skip that, as does `allow_missing_weights`).
    """
    path, dtype = Path(path), dtype_name(dtype)
    if (path / owned.RECORD).is_file() and not (path / "config.json").is_file():
        raise NormswapError(f"{path} holds a module without a transformers config ({owned.RECORD}): rebuild it "
                            "with normswap.restore(model, folder) on a fresh instance of its class")
    raw = read_config(path)
    section = raw.get("normswap")
    if not section:
        raise NormswapError(f"{path} was not saved by normswap (no 'normswap' section in config.json)")
    schema.validate(section, str(path))
    if not safetensors.has_weights(path):
        raise NormswapError(f"{path} has no {' nor '.join(safetensors.weights_names(path))}")
    schema.verify_checksum(section, None, str(path))   # a hand-edited section: refused before building
    try:
        config, cls = base_config(raw, section, str(path))
    except NormswapError:
        raise
    except Exception as e:
        why = first_line(e, type(e).__name__)
        raise NormswapError(f"{path}: bad config.json: {why}") from None
    stored = DTYPES.get(str(getattr(config, "dtype", None) or "float32").replace("torch.", ""), torch.float32)
    model = build_model(cls, config, DTYPES[dtype] if dtype else stored)
    with reraised(portable.InvalidConversion):
        fixes.rebuild(model, section, str(path), build_norm)   # what the shipped modeling_normswap.py runs
    _warn_old_code(path, section)
    _load_weights(model, path, allow_missing_weights)
    if not allow_missing_weights:   # names, shapes and sizes as saved (the values are not hashed)
        schema.verify_checksum(section, path, str(path))
    _load_generation_config(model, path)
    # the values: the model built here computes what was saved
    schema.verify_fingerprint(model.eval(), section, str(path), check_fingerprint and not allow_missing_weights)
    adopt(model)   # as converted in memory: its own save_pretrained writes a complete folder
    return model


def _load_generation_config(model: nn.Module, path: Path) -> None:
    """generation_config.json, as transformers' from_pretrained reads it (eos lists, pad, sampling settings,
    max_new_tokens): without it, heal and export would write the defaults derived from config.json."""
    if not (path / "generation_config.json").is_file() or getattr(model, "generation_config", None) is None:
        return
    try:
        model.generation_config = transformers.GenerationConfig.from_pretrained(path)
    except Exception as e:  # transformers' own validation: a bad file is an error, not a silent default
        raise NormswapError(f"{path}/generation_config.json: {first_line(e)}") from None
