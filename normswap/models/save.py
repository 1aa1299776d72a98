"""Saving a (converted) model, atomically: in Hugging Face layout, config.json with its `normswap` section
(validated on load by `folder.schema`, with a checksum and a fingerprint), the weights (a converted model's as
the "normswap" variant, model.normswap.safetensors, sharded with an index above max_shard_size),
modeling_normswap.py (`folder.modeling`), generation config and tokenizer files; a module without a transformers
config, its weights and normswap.json (the same section, rebuilt by `restore`). The section is sealed and written
by `folder.section.write`, the code the folder ships: the same as the model's own save_pretrained runs."""
from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from collections.abc import Callable, Iterable

import torch
from torch import nn

from normswap.io.atomic import Held, atomic_dir
from normswap.io import kept, safetensors
from normswap.folder.checksum import VARIANT
from normswap.folder.section import Base, Section, write
from normswap.errors import NormswapError
from normswap.folder import modeling
from normswap.models.adopt import original_class
from normswap.models.introspect import is_causal_lm
from normswap.models.names import renamed_modules, saved_names
from normswap.models.wrapped import unwrapped
from normswap.folder.attached import MODULE_TYPE, has_config, qualified_name, set_section
from normswap.folder.attached import section as module_section
from normswap.models.source import transformers_class


def save_pretrained(model: nn.Module, out: str | Path, tokenizer=None, overwrite: bool | str = False,
                    max_shard_size: int | str = safetensors.DEFAULT_MAX_SHARD_SIZE,
                    check: Callable[[Path], None] | None = None,
                    tensors: Iterable[torch.Tensor] | None = None, files: dict[str, str] | None = None,
                    source: str | Path | None = None, lock: Held | None = None,
                    fingerprint: Callable[[Path], dict] | None = None) -> Path:
    """Save a (converted) HF model to `out` as config.json + model.safetensors, sharded with an index above
    max_shard_size (e.g. "5GB"), + tokenizer. check(folder), if given, runs on the written folder before
    it replaces `out`; raising aborts the save. tensors: the weights in `safetensors.saved_specs(model)`
    order, when they are not the model's own (the lazy conversion computes them as they are written). files: more text
    files to write beside the weights, name -> content (heal's heal_log.json; names in `owned.FILES`).

    A module without a transformers config (any nn.Module) is saved as model.safetensors (sharded likewise)
    and normswap.json: its normswap section (an unconverted one: an empty record), which `normswap.restore`
    rebuilds on a fresh instance of its class.

    overwrite: True replaces an empty folder or one normswap wrote; "any" replaces any folder.
    source: the model's folder, whose other files its loaders read OUT keeps (`io.kept`: sentence-transformers'
    modules, the slow tokenizer's files, generation settings); a file linked from outside it is refused.
    lock: OUT's lock, held by the caller since before its work (`io.atomic.held`: heal's training).
    fingerprint(folder), if given, computes the fingerprint from the written folder after `check` (lazy conversion:
    `model` is on meta); by default it is recorded from `model` itself.
    """
    if not isinstance(model, nn.Module):
        raise NormswapError(f"`model` must be a torch.nn.Module, not {type(model).__name__}")
    safetensors.parse_size(max_shard_size)   # a bad size fails before anything else
    model = unwrapped(model)   # nn.DataParallel, torch.compile: the model inside, as `convert` converted it
    if not has_config(model):
        return save_module(model, out, tokenizer, overwrite, max_shard_size, check, tensors, files, lock, fingerprint)
    section, cls = getattr(model.config, "normswap", None), original_class(model)
    if section and transformers_class(cls.__name__) is not cls:
        raise NormswapError(f"cannot save the converted {cls.__name__}: it is not a transformers class (its "
                            "code came from a model folder or from you), so the saved folder could not be rebuilt "
                            "exactly, in normswap or in plain transformers; nothing was written")
    if getattr(model.config, "transformers_weights", None):   # the source's weights file name, not ours
        delattr(model.config, "transformers_weights")
    model.config.architectures = [cls.__name__]  # what from_pretrained rebuilds (as HF does)
    model.config.dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    _record_untied(model)
    saved = saved_names(model)   # transformers' names on disk, which transformers 4 builds
    with atomic_dir(out, overwrite, lock) as tmp:
        # tied tensors once, restored by loading; a converted model's as the variant its own classes read
        safetensors.save_model(model, tmp, max_shard_size, tensors, saved, VARIANT if section else None)
        if section:   # the class to rebuild (whatever config.json's architectures say)
            section["base"] = {"architecture": cls.__name__, "model_type": model.config.model_type}
            section.pop("renamed", None)
            if renamed := renamed_modules(saved):
                section["renamed"] = renamed
        model.config.save_pretrained(tmp)
        if section:   # fingerprint, checksum, modeling file + auto_map: loads in transformers without normswap
            _finish(model, tmp, pending=fingerprint is not None)
        names = kept.copy_kept(source, tmp) if source is not None else []   # before the files normswap rewrites
        if getattr(model, "generation_config", None) is not None and is_causal_lm(model.config):
            with contextlib.suppress(Exception):
                model.generation_config.save_pretrained(tmp)
        if tokenizer is not None:
            save_tokenizer(tokenizer, tmp)
        for name, text in (files or {}).items():
            (tmp / name).write_text(text)
        kept.record(tmp, names)
        if check is not None:
            check(tmp)
        if section and fingerprint is not None:
            _finish(model, tmp, fingerprint(tmp))
    return Path(out)


def _finish(model: nn.Module, folder: Path, found: dict | None = None, pending: bool = False) -> None:
    """`folder.section.write` with this model's code: the fingerprint `found`, or none yet (`pending`: the caller
    computes it from the written folder), or recorded from the model."""
    section = model.config.normswap
    probe_only = {k: v for k, v in (section.get("fingerprint") or {}).items() if k == "probe"}
    write(model, folder, section, modeling.code(section), found or (probe_only if pending else None))


def module_record(model: nn.Module) -> dict:
    """What normswap.json records: the model's section (updated in place, as config.normswap is), or an empty
    one for an unconverted module; its `base` names the class, for information (`restore` checks structure)."""
    base = Base(qualified_name(type(model)), MODULE_TYPE)
    record = module_section(model)
    if record is None:
        return Section.new(base, output_fixes={}).to_dict()
    record.update(base=dataclasses.asdict(base))
    return record


def save_module(model: nn.Module, out: str | Path, tokenizer=None, overwrite: bool | str = False,
                max_shard_size: int | str = safetensors.DEFAULT_MAX_SHARD_SIZE,
                check: Callable[[Path], None] | None = None,
                tensors: Iterable[torch.Tensor] | None = None, files: dict[str, str] | None = None,
                lock: Held | None = None, fingerprint: Callable[[Path], dict] | None = None) -> Path:
    """`save_pretrained` for a module without a transformers config: weights (tied tensors once, the "normswap"
    variant) and normswap.json, the section sealed (fingerprint, checksum of itself and of the weights' headers)."""
    record = module_record(model)
    with atomic_dir(out, overwrite, lock) as tmp:
        safetensors.save_model(model, tmp, max_shard_size, tensors, variant=VARIANT)
        record = write(model, tmp, record, fingerprint=fingerprint(tmp) if fingerprint else None)
        if module_section(model) is not None:   # as a transformers config's section is updated by its save
            set_section(model, record)
        if tokenizer is not None:
            save_tokenizer(tokenizer, tmp)
        for name, text in (files or {}).items():
            (tmp / name).write_text(text)
        if check is not None:
            check(tmp)
    return Path(out)


def save_tokenizer(tokenizer, folder: Path) -> None:
    """`tokenizer.save_pretrained(folder)`, with a tokenizer_config.json that transformers 4.x (and optimum,
    which needs it) loads too: transformers 5 names its generic tokenizer.json class `TokenizersBackend`, which
    4.x lacks; `PreTrainedTokenizerFast` is that class in both (5 maps it back). `model_input_names` keeps 4.x
    from adding token_type_ids, which generate(**encoded) refuses; where it was loaded from is dropped."""
    tokenizer.save_pretrained(folder)
    path = Path(folder) / "tokenizer_config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if config.get("tokenizer_class") == "TokenizersBackend" and (Path(folder) / "tokenizer.json").is_file():
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.setdefault("model_input_names", list(getattr(tokenizer, "model_input_names", None) or []) or None)
    config = {k: v for k, v in config.items() if k not in ("is_local", "local_files_only") and v is not None}
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


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
