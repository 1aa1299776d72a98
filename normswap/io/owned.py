"""What normswap writes, and how to tell a folder or file it wrote from anyone else's.

`overwrite=True` replaces only such outputs (`atomic.check_replaceable`): a converted folder (config.json
with a section only normswap writes, or a module's normswap.json), a deployment folder (model.onnx carrying
normswap's metadata), or an ONNX file normswap exported; each holding nothing but the files normswap writes and
those it kept of the source (listed in its config.json).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from normswap.io.kept import recorded

RECORD = "normswap.json"   # what changed, beside the weights of a module without a transformers config
# What save_pretrained and export_folder write (config or record, weights, generation config, tokenizer files,
# graph, heal's log).
FILES = frozenset({RECORD,
    "config.json", "generation_config.json", "model.safetensors", "modeling_normswap.py", "tokenizer.json",
    "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
    "chat_template.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model",
    "sentencepiece.bpe.model", "spm.model", "model.safetensors.index.json",
    "model.normswap.safetensors", "model.safetensors.index.normswap.json",   # a converted folder's weights
    "model.onnx", "model.onnx.data", "genai_config.json", "heal_log.json"})
SHARD = re.compile(r"model(\.normswap)?-\d{5}-of-\d{5}\.safetensors")
SECTIONS = ("normswap", "normswap_heal")   # config.json keys only normswap writes
ONNX_MARK = "normswap.target"              # metadata key of every graph normswap exports


def exported_onnx(path: str | os.PathLike) -> bool:
    """An ONNX file normswap exported (its metadata carries ONNX_MARK)."""
    try:
        import onnx
        props = onnx.load(str(path), load_external_data=False).metadata_props
    except Exception:
        return False
    return any(p.key == ONNX_MARK for p in props)


def _record(out: Path) -> bool:
    """A folder holding a module's record (normswap.json: a section whose `format` is set)."""
    try:
        record = json.loads((out / RECORD).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and "format" in record and "norms" in record


def foreign(out: Path) -> str | None:
    """Why the existing folder `out` is not normswap's to replace (None: empty, or normswap's own)."""
    entries = sorted(os.listdir(out))
    if not entries:
        return None
    try:
        config = json.loads((out / "config.json").read_text())
    except (OSError, ValueError):
        config = None
    onnx_folder = (out / "model.onnx").is_file() and exported_onnx(out / "model.onnx")
    if not (isinstance(config, dict) and (any(k in config for k in SECTIONS) or onnx_folder) or _record(out)):
        return "was not written by normswap (no config.json with a 'normswap' section)"
    kept = recorded(config)   # the source's files a converted folder keeps (`io.kept`), as it lists them
    alien = [e for e in entries
             if e not in kept and (not (e in FILES or SHARD.fullmatch(e)) or not (out / e).is_file())]
    if alien:
        more = f" and {len(alien) - 3} more" if len(alien) > 3 else ""
        return f"holds files normswap does not write ({', '.join(alien[:3])}{more})"
    return None
