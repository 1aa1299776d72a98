"""Saving a (converted) model in Hugging Face layout, atomically: config.json with its `normswap` section
(validated on load by `schema`, with a checksum), model.safetensors (sharded with an index above
max_shard_size), modeling_normswap.py (`hub`), generation config and tokenizer files."""
from __future__ import annotations

import contextlib
from pathlib import Path
from collections.abc import Callable, Iterable

import torch
from torch import nn

from normswap.atomic import atomic_dir
from normswap.checkpoint import safetensors
from normswap.errors import NormswapError
from normswap.models import schema
from normswap.models.hub import make_self_describing
from normswap.models.introspect import is_causal_lm


def save_pretrained(model: nn.Module, out: str | Path, tokenizer=None, overwrite: bool | str = False,
                    max_shard_size: int | str = safetensors.DEFAULT_MAX_SHARD_SIZE,
                    check: Callable[[Path], None] | None = None,
                    tensors: Iterable[torch.Tensor] | None = None, files: dict[str, str] | None = None) -> Path:
    """Save a (converted) HF model to `out` as config.json + model.safetensors, sharded with an index above
    max_shard_size (e.g. "5GB"), + tokenizer. check(folder), if given, runs on the written folder before
    it replaces `out`; raising aborts the save. tensors: the weights in `safetensors.saved_specs(model)`
    order, when they are not the model's own (streaming computes them as they are written). files: more text
    files to write beside the weights, name -> content (heal's heal_log.json; names in `owned.FILES`).

    overwrite: True replaces an empty folder or one normswap wrote; "any" replaces any folder.
    """
    if not hasattr(model, "config"):
        raise NormswapError("save_pretrained needs a Hugging Face model (with .config)")
    model.config.architectures = [type(model).__name__]  # what from_pretrained rebuilds (as HF does)
    model.config.dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    _record_untied(model)
    section = getattr(model.config, "normswap", None)
    with atomic_dir(out, overwrite) as tmp:
        safetensors.save_model(model, tmp, max_shard_size, tensors)  # tied tensors once, restored by loading
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
        for name, text in (files or {}).items():
            (tmp / name).write_text(text)
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
