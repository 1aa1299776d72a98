"""Loading a model and its tokenizer from a SRC: a folder, a Hub id or `normswap-demo`.

Loading runs no code from a model folder unless trust_remote_code is given, and refuses weights that
do not match the config unless allow_missing_weights is given. Folders normswap saved are rebuilt by
`rebuild.from_pretrained`, never through their own modeling file. A local folder is read as a lazy conversion
reads it (`pipeline.lazy_convert`): the same weights files, headers validated first, the same dtype
(`load_dtype`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer

from normswap.choices import LoadDtype, options_from
from normswap.io import safetensors
from normswap.errors import NormswapError, first_line
from normswap.models.demo import DEMO_NAME
from normswap.models.rebuild import from_pretrained
from normswap.models.source import (DTYPE_NAMES, DTYPES, auto_class, check_code, check_weights, dtype_name, load_dtype,
                                    read_config, resolve_source, weights_reader)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model",
                   "spiece.model")


@dataclass(frozen=True)
class LoadOptions:
    """How to load a SRC: `load_model(src, options)` or its fields as keywords (the CLI builds one per command).
    Field metadata: the flag that sets each field on the command line, and its help."""
    # None: as stored; also fp32, fp16, bf16 or a torch.dtype, kept as the long name
    dtype: LoadDtype | None = field(default=None, metadata=dict(
        flag="--dtype", choices=tuple(DTYPE_NAMES),
        help="Load the model in this dtype (default: as stored; the demo model: fp32)."))
    trust_remote_code: bool = field(default=False, metadata=dict(   # run Python files shipped with the model
        flag="--trust-remote-code",
        help="Run the Python code a model folder ships (auto_map). Default: never run it, never prompt."))
    allow_missing_weights: bool = field(default=False, metadata=dict(   # load even if tensors do not match
        flag="--allow-missing-weights",
        help="Load SRC even if its weights lack tensors, have extra ones or wrong shapes (missing ones get random "
             "values). Default: an error naming them."))

    def __post_init__(self):
        object.__setattr__(self, "dtype", dtype_name(self.dtype))   # fp16, torch.float16 -> "float16"


def load_model(src: str | os.PathLike, options: LoadOptions | None = None, **keywords):
    """(model, tokenizer or None) from a folder, a Hub id or `normswap-demo`; in eval mode.

    `options` (a LoadOptions) or its fields as keywords (both only where they agree):
    dtype: "float32" | "float16" | "bfloat16" (or fp32, fp16, bf16, a torch.dtype) | None (as stored; the demo
    model loads in float32).
    trust_remote_code: run Python files shipped with the model (auto_map); never by default.
    allow_missing_weights: load even if tensors are missing, unexpected or of the wrong shape (missing
    ones keep random values); by default that is an error naming them.
    """
    o = options_from(LoadOptions, options, keywords)
    src = os.fspath(src)
    dtype, trust_remote_code, allow_missing_weights = o.dtype, o.trust_remote_code, o.allow_missing_weights
    where, local = resolve_source(src)
    if src == DEMO_NAME and dtype is None:
        dtype = "float32"
    if local and "normswap" in read_config(where):  # our own folders: rebuilt without AutoConfig or remote code
        model = from_pretrained(where, dtype=dtype, allow_missing_weights=allow_missing_weights).eval()
        return model, load_tokenizer(where, config=model.config)  # the original config, not normswap_<type>
    if local:
        check_code(src, read_config(where), trust_remote_code, converting=False)
    # Every header transformers will read, validated before it reads a byte (as the lazy conversion does).
    reader = weights_reader(src, where) if local and safetensors.has_weights(where) else None
    try:
        config = AutoConfig.from_pretrained(where, local_files_only=local, trust_remote_code=trust_remote_code)
        if getattr(config, "normswap", None):
            model = from_pretrained(where, dtype=dtype, allow_missing_weights=allow_missing_weights)
        else:
            load_as = DTYPES[dtype] if dtype else load_dtype(src, config, reader) if reader else "auto"
            model, info = auto_class(config).from_pretrained(
                where, local_files_only=local, trust_remote_code=trust_remote_code,
                dtype=load_as, output_loading_info=True, ignore_mismatched_sizes=True)
            check_weights(src, info["missing_keys"], info["unexpected_keys"],
                          [(k, a, b) for k, a, b in info["mismatched_keys"]], allow_missing_weights)
    except NormswapError:
        raise
    except Exception as e:  # transformers raises many types; users get one line
        msg = first_line(e, type(e).__name__)
        if not trust_remote_code and (local and "auto_map" in read_config(where) or asks_for_remote_code(e)):
            msg = "it ships its own Python code (auto_map), which normswap runs only with `trust_remote_code=True`"
        raise NormswapError(f"cannot load model from {src}: {msg}") from None
    return model.eval(), load_tokenizer(where, local, trust_remote_code)


def asks_for_remote_code(e: Exception) -> bool:
    """Whether transformers refused to load a model for want of `trust_remote_code` (a Hub model shipping its
    own code). It raises a plain ValueError and says so only in its text: this is the one place that reads it."""
    return "trust_remote_code" in str(e)


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
