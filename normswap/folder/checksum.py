"""The weights files a converted folder's loaders read, and the checksum of its section and their headers.

Shipped with `portable.py` in every folder's modeling_normswap.py, from the line SHIPPED_FROM on.

Since format 4 a converted folder stores its weights as transformers' *variant* "normswap"
(`model.normswap.safetensors`, or `model.normswap-0000i-of-0000n.safetensors` with
`model.safetensors.index.normswap.json`), the names transformers itself writes and reads for
`save_pretrained(variant=...)` / `from_pretrained(variant=...)`. The folder's own classes ask for that variant;
the original class, which does not, finds no weights and fails loudly (`GPT2LMHeadModel.from_pretrained(out)`:
"no file named model.safetensors") instead of loading converted weights into LayerNorms.
"""
from __future__ import annotations

from normswap.folder.portable import InvalidConversion, check_section_hash, section_hash, sha256

# ---- shipped from here: the weights files and the checksum -----------------------------------------------------
import json  # noqa: E402  (the shipped file concatenates modules: each brings its own imports)
import os  # noqa: E402
import struct  # noqa: E402
from pathlib import Path  # noqa: E402

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
VARIANT = "normswap"
VARIANT_FORMAT = 4   # the first format whose weights are the variant


def variant_of(section) -> str | None:
    """The weights variant of a folder with this section: "normswap" from format 4 on, else None."""
    fmt = section.get("format") if isinstance(section, dict) else None
    return VARIANT if isinstance(fmt, int) and not isinstance(fmt, bool) and fmt >= VARIANT_FORMAT else None


def with_variant(name: str, variant: str | None) -> str:
    """A weights file name as transformers writes it for `variant`: model.safetensors -> model.V.safetensors,
    model-00001-of-00002.safetensors -> model.V-00001-of-00002.safetensors, model.safetensors.index.json ->
    model.safetensors.index.V.json."""
    if not variant:
        return name
    if name == INDEX:
        return f"model.safetensors.index.{variant}.json"
    return f"model.{variant}{name[len('model'):]}" if name.startswith("model-") else \
        name.replace(".safetensors", f".{variant}.safetensors", 1)


def _inside(folder: Path, name, what: str) -> Path:
    path = folder / name if isinstance(name, str) and name else None
    if path is None or os.path.commonpath([os.path.abspath(folder), os.path.abspath(path)]) != os.path.abspath(folder):
        raise InvalidConversion(f"{folder}: {what} {name!r} is not a file inside the folder")
    if not path.is_file():
        raise InvalidConversion(f"{folder}: {what} {name} is missing")
    return path


def read_index(file: Path) -> dict:
    """A sharded checkpoint's index.json as a dict with a `weight_map` of tensor name -> shard file."""
    try:
        index = json.loads(Path(file).read_text())
        if not isinstance(index["weight_map"], dict):
            raise TypeError
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        raise InvalidConversion(f"{file} is not a safetensors index (no weight_map)") from None
    return index


def weights_source(folder: str | Path, explicit: str | None = None, variant: str | None = None) -> str:
    """The weights file or index transformers loads from `folder`: config.json's `transformers_weights` when
    set, else the (variant's) single file when it exists (an index beside it is ignored), else its index."""
    folder = Path(folder)
    weights, index = with_variant(WEIGHTS, variant), with_variant(INDEX, variant)
    name = explicit or (weights if (folder / weights).is_file() else index if (folder / index).is_file() else None)
    if name is None:
        raise InvalidConversion(f"{folder} has no {weights} nor {index}")
    _inside(folder, name, "weights file")
    return name


def weights_files(folder: str | Path, explicit: str | None = None, variant: str | None = None) -> list[str]:
    """The safetensors files transformers loads from `folder`, by name, in its order (`weights_source`, or the
    shards its index lists, sorted)."""
    folder = Path(folder)
    name = weights_source(folder, explicit, variant)
    if not name.endswith(".json"):
        return [name]
    files = sorted(set(read_index(folder / name)["weight_map"].values()), key=str)
    for shard in files:
        _inside(folder, shard, f"shard listed in {name}:")
    return files


def raw_header(file: Path) -> bytes:
    """The JSON header of a safetensors file, as stored (tensor names, dtypes, shapes, offsets)."""
    with open(file, "rb") as f:
        try:
            (n,) = struct.unpack("<Q", f.read(8))
        except struct.error:
            raise InvalidConversion(f"{file} is not a safetensors file (shorter than its header)") from None
        if n > os.fstat(f.fileno()).st_size - 8:
            raise InvalidConversion(f"{file} is not a safetensors file (its header runs past the end)")
        return f.read(n)


def checksum(section: dict, folder: str | Path | None, explicit: str | None = None) -> dict:
    """Hashes of the section (without its checksum) and, given `folder`, of its weights files' headers
    (names, dtypes, shapes, offsets; one file hashes as its header alone, shards as name + header each)."""
    out = {"section": section_hash(section)}
    if folder is not None:
        variant = variant_of(section)
        files = weights_files(folder, explicit, variant)
        headers = [raw_header(Path(folder) / name) for name in files]
        joined = headers[0] if files == [with_variant(WEIGHTS, variant)] else b"".join(
            name.encode() + b"\0" + header for name, header in zip(sorted(files), headers))
        out["weights_header"] = sha256(joined)
    return out


def verify_checksum(section: dict, folder: str | Path | None, where: str, explicit: str | None = None) -> None:
    """Refuse a section edited after it was saved; given `folder`, also weights other than the ones saved."""
    check_section_hash(section, where)
    if folder is not None and section["checksum"]["weights_header"] != checksum(section, folder, explicit)[
            "weights_header"]:
        raise InvalidConversion(f"{where}: the weights are not the ones saved with this config (their tensor names, "
                                "shapes or sizes differ: checksum mismatch)")
