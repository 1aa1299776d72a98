"""Per-architecture adapters for the exact conversion: where things are, declared, not computed.

An adapter is a function `config -> Arch` registered for one or more `config.model_type`s; it raises
`NotExact` for configurations it cannot handle exactly (post-LN variants...). Paths are relative to the
model's backbone (`model.base_model`), block paths relative to each block. Parallel blocks need no
special field: a norm read by both attention and MLP simply lists both consumers.
Adding an architecture = one small file here + its import at the bottom + a test.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from normswap.errors import NormswapError


class NotExact(NormswapError):
    """The exact conversion cannot be applied to this model (`auto` falls back to naive)."""


@dataclass
class Arch:
    embeddings: list[str]            # token/position embeddings (or an input projection) writing the stream
    blocks: str                      # the ModuleList of blocks
    norms: dict[str, list[str]]      # block norm -> the Linear/Conv1D layers reading its output
    writers: list[str]               # block layers whose output is added to the residual stream
    final_norm: str
    final_consumers: list[str] = field(default_factory=list)  # empty: the model's head(s) read it
    embed_norm: str | None = None    # a norm between the embeddings and the stream (BLOOM)


ADAPTERS: dict[str, Callable[[object], Arch]] = {}

# Post-LN families: the residual stream carries LayerNorm outputs, whose mean depends on the input.
POST_LN = {"bert", "roberta", "xlm-roberta", "distilbert", "bart", "electra", "albert", "camembert",
           "deberta", "deberta-v2", "ernie", "marian", "mpnet", "squeezebert", "layoutlm", "blenderbot-small"}


def register(*model_types: str):
    def deco(fn: Callable[[object], Arch]):
        for t in model_types:
            ADAPTERS[t] = fn
        return fn
    return deco


def post_ln(model_type: str) -> NotExact:
    return NotExact(f"{model_type} is post-LN (its residual stream carries LayerNorm outputs, whose mean "
                    "depends on the input), so no exact RMSNorm form exists")


def adapter_for(config) -> Arch:
    """The Arch of a model config, or NotExact saying why there is none."""
    model_type = getattr(config, "model_type", None) or "unknown"
    if model_type in POST_LN:
        raise post_ln(model_type)
    if model_type not in ADAPTERS:
        raise NotExact(f"no exact adapter for model type '{model_type}' (supported: "
                       f"{', '.join(sorted(ADAPTERS))})")
    return ADAPTERS[model_type](config)


from normswap.surgery.adapters import (bloom, codegen, falcon, gpt2, gpt_neo, gpt_neox, gptj, opt,  # noqa: E402,F401
                                       phi)
