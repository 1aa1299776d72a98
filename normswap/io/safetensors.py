"""Safetensors checkpoints in the Hugging Face layout, one file or sharded with an index, read and written
a tensor at a time.

Reading copies a tensor into its own anonymous memory (`Reader`), or maps it copy-on-write from the file
(`Reader(path, mapped=True)`: no copy, no page zeroing; a lazy conversion reads every tensor several times, and
this made its reads 50x cheaper). Either way only the tensors asked for are resident, and freeing one
returns its memory at once. Writing plans the shards from tensor sizes first (names and shapes are known before any
value is), writes each file's header, then appends each tensor's bytes as it is produced: peak memory is
one tensor, not one shard. Files are `model.safetensors`, or `model-0000i-of-0000n.safetensors` plus
`model.safetensors.index.json` (`metadata.total_size`, `weight_map`), as transformers writes them.
"""
from __future__ import annotations

import json
import mmap
import os
import re
import shutil
import struct
from pathlib import Path
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from normswap.errors import NormswapError, first_line, reraised
from normswap.io import owned
from normswap.folder import checksum, portable

WEIGHTS, INDEX = checksum.WEIGHTS, checksum.INDEX
DEFAULT_MAX_SHARD_SIZE = "50GB"  # transformers 5's save_pretrained default
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_CODES = {v: k for k, v in _DTYPES.items()}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes (at least 1) in "5GB", "500MB", "2GiB" or an int (transformers' units: GB = 10^9)."""
    bad = NormswapError(f"bad shard size {size!r} (`max_shard_size`): use e.g. 5GB, 500MB or a number of bytes "
                        "(at least 1)")
    if isinstance(size, bool):
        raise bad
    if isinstance(size, int):
        n = size
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]I?B|B)?\s*", str(size).upper())
        n = int(float(m.group(1)) * _UNITS[m.group(2) or ""]) if m else 0
    if n < 1:
        raise bad
    return n


def human(n: int) -> str:
    """A byte count for people: 1.23 GB, 4.5 MB, 812 bytes (GB = 10^9, as disk tools and transformers)."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} bytes"


def nbytes(shape, dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty(0, dtype=dtype).element_size()


def total_bytes(specs: list[tuple[str, torch.dtype, list[int]]]) -> int:
    """Bytes of the tensors `specs` (name, dtype, shape) describe."""
    return sum(nbytes(shape, dtype) for _, dtype, shape in specs)


def has_weights(path: str | Path) -> bool:
    """Whether the folder holds the weights files its loaders read (`weights_names`)."""
    return any((Path(path) / name).exists() for name in weights_names(path))


def weights_names(path: str | Path) -> tuple[str, str]:
    """(single file, index) of the weights the folder's loaders read: the "normswap" variant's for a folder
    normswap converted (format 4 on, `checksum.variant_of`), else transformers' plain names."""
    variant = checksum.variant_of(_section(Path(path)))
    return checksum.with_variant(WEIGHTS, variant), checksum.with_variant(INDEX, variant)


def _section(path: Path) -> dict | None:
    """The folder's normswap section (config.json's, or a module's normswap.json), None if it has none."""
    for file, key in (("config.json", "normswap"), (owned.RECORD, None)):
        try:
            data = json.loads((path / file).read_text())
        except (OSError, ValueError):
            continue
        found = data.get(key) if key and isinstance(data, dict) else data
        if isinstance(found, dict):
            return found
    return None


def _stamp(file: Path) -> tuple | None:
    """What changes when a file is written or replaced: inode, size, modification and change times."""
    try:
        st = os.stat(file)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


class Reader:
    """Tensors of a checkpoint folder, read one at a time: the files transformers would load (`weights_files`:
    model.safetensors wins over an index beside it), every header validated before any tensor is read."""

    def __init__(self, path: str | Path, mapped: bool = False):
        path, self.mapped = Path(path), mapped
        explicit, variant = _explicit_weights(path), checksum.variant_of(_section(path))
        with reraised(portable.InvalidConversion):
            source = checksum.weights_source(path, explicit, variant)
            self.files = [path / name for name in checksum.weights_files(path, explicit, variant)]
            index = checksum.read_index(path / source) if source.endswith(".json") else {}
        metadata = index.get("metadata")
        self.index_dtype = metadata.get("dtype") if isinstance(metadata, dict) else None
        self.entries: dict[str, tuple[Path, torch.dtype, list[int], int, int]] = {}
        self.stamps = {file: _stamp(file) for file in self.files}   # before the headers: see `check_unchanged`
        for file in self.files:
            for key, (dtype, shape, start, end) in _header(file).items():
                if key in self.entries:
                    raise NormswapError(f"{path}: tensor {key} is stored in two files ({self.entries[key][0].name} "
                                        f"and {file.name})")
                self.entries[key] = (file, dtype, shape, start, end)

    def keys(self) -> list[str]:
        return list(self.entries)

    def check_unchanged(self, src: str) -> None:
        """Raise if a weights file was rewritten or replaced since its header was read: what was read from it
        may mix old and new tensors."""
        for file, stamp in self.stamps.items():
            if _stamp(file) != stamp:
                raise NormswapError(f"{src}: {file.name} changed while it was read (rewritten or replaced): "
                                    "nothing written; run again once SRC stays as it is")

    def meta(self, key: str) -> tuple[torch.dtype, list[int]]:
        return self.entries[key][1], self.entries[key][2]

    def get(self, key: str) -> torch.Tensor:
        file, dtype, shape, start, end = self.entries[key]
        if self.mapped and end > start:
            return _mapped(file, key, dtype, shape, start, end)
        # An anonymous mmap, not the heap: freeing the tensor returns the memory to the system at once
        # (glibc keeps freed heap blocks of a few MB, which made RSS drift up to the model's size).
        buf = mmap.mmap(-1, end - start) if end > start else bytearray()
        with open(file, "rb") as f:
            f.seek(start)
            if f.readinto(buf) != len(buf):
                raise NormswapError(f"{file} is truncated (tensor {key})")
        if not buf:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(shape)

    def total_size(self) -> int:
        return sum(e[4] - e[3] for e in self.entries.values())


def _mapped(file: Path, key: str, dtype: torch.dtype, shape: list[int], start: int, end: int) -> torch.Tensor:
    """The tensor's bytes mapped copy-on-write (ACCESS_COPY): edits stay private, the file is never
    written. The mapping lives as long as the tensor; a file replaced on disk meanwhile (rename) keeps
    the old bytes, since the mapping holds the old inode."""
    offset = start - start % mmap.ALLOCATIONGRANULARITY
    with open(file, "rb") as f:
        if os.fstat(f.fileno()).st_size < end:
            raise NormswapError(f"{file} is truncated (tensor {key})")
        buf = mmap.mmap(f.fileno(), end - offset, access=mmap.ACCESS_COPY, offset=offset)
    return torch.frombuffer(buf, dtype=dtype, offset=start - offset,
                            count=(end - start) // dtype.itemsize).reshape(shape)


def _explicit_weights(path: Path) -> str | None:
    """config.json's `transformers_weights` (the weights file transformers is told to load), if any."""
    try:
        name = json.loads((path / "config.json").read_text()).get("transformers_weights")
    except (OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) else None


def _unique(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"tensor {next(k for k in keys if keys.count(k) > 1)} appears twice")
    return dict(pairs)


def _header(file: Path) -> dict[str, tuple[torch.dtype, list[int], int, int]]:
    """key -> (dtype, shape, absolute start, absolute end) from a safetensors file's header, validated as the
    safetensors library validates it before anything is read: the tensors' byte ranges, in order of offset,
    follow each other from the end of the header to the end of the file with no gap and no overlap, and each
    holds exactly shape x dtype bytes (so no tensor reads another's bytes, or memory no file backs)."""
    with reraised(portable.InvalidConversion):
        raw = checksum.raw_header(file)

    def bad(why: str) -> NormswapError:
        return NormswapError(f"{file} is not a valid safetensors file: {why}")
    try:
        header = json.loads(raw.decode(), object_pairs_hook=_unique) if raw.startswith(b"{") else None
    except ValueError as e:   # JSONDecodeError, UnicodeDecodeError, a duplicate name
        raise bad(f"bad header ({first_line(e)})") from None
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    data = os.path.getsize(file) - 8 - len(raw)
    ranges = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        ok = isinstance(info, dict) and all(isinstance(info.get(k), list) for k in ("shape", "data_offsets"))
        numbers = info["shape"] + info["data_offsets"] if ok else []
        if not ok or len(info["data_offsets"]) != 2 or not all(type(n) is int and n >= 0 for n in numbers):
            raise bad(f"tensor {key} has no valid dtype, shape and data_offsets")
        if info.get("dtype") not in _DTYPES:
            raise NormswapError(f"{file}: unsupported dtype {info.get('dtype')} for {key}")
        ranges.append((*info["data_offsets"], key, _DTYPES[info["dtype"]], info["shape"]))
    end = 0
    out = {}
    for start, stop, key, dtype, shape in sorted(ranges, key=lambda r: r[:2]):
        if start != end:
            raise bad(f"tensor {key} starts at byte {start} of the data, not at {end} where the previous one ends "
                      f"({'it overlaps another' if start < end else 'a gap'})")
        if stop - start != nbytes(shape, dtype):
            raise bad(f"tensor {key} is given {stop - start} bytes, its shape {shape} in {dtype} needs "
                      f"{nbytes(shape, dtype)}")
        end = stop
        out[key] = (dtype, shape, 8 + len(raw) + start, 8 + len(raw) + stop)
    if end > data:
        raise NormswapError(f"{file} is truncated: its tensors need {end} bytes after the header, it holds {data}")
    if end < data:
        raise bad(f"{data - end} bytes after its last tensor, which no tensor covers")
    return out


def plan_shards(specs: list[tuple[str, torch.dtype, list[int]]], max_shard_size: int | str) -> list[list[int]]:
    """Split tensors (in order) into shards of at most max_shard_size bytes (a bigger tensor: alone)."""
    limit = parse_size(max_shard_size)
    shards: list[list[int]] = [[]]
    size = 0
    for i, (_, dtype, shape) in enumerate(specs):
        n = nbytes(shape, dtype)
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += n
    if len(shards) > 99999:   # the file names hold 5 digits, as transformers writes them
        raise NormswapError(f"`max_shard_size` {max_shard_size} would write {len(shards)} shards (at most 99999): "
                            "choose a larger size")
    return shards


def write(out: str | Path, specs: list[tuple[str, torch.dtype, list[int]]], tensors: Iterable[torch.Tensor],
          max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, variant: str | None = None) -> list[str]:
    """Write tensors (yielded in the order of `specs`: name, dtype, shape) to `out`, under transformers' names
    for `variant` (`checksum.with_variant`); the file names.

    Each tensor is written as soon as it is yielded and can be freed afterwards.
    """
    out = Path(out)
    shards = plan_shards(specs, max_shard_size)
    names = [WEIGHTS] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                                 for i in range(len(shards))]
    names = [checksum.with_variant(name, variant) for name in names]
    given: Iterator[torch.Tensor] = iter(tensors)
    weight_map = {}
    for fname, idx in zip(names, shards):
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for i in idx:
            key, dtype, shape = specs[i]
            n = nbytes(shape, dtype)
            header[key] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
            weight_map[key] = fname
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
        with open(out / fname, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for i in idx:
                key, dtype, shape = specs[i]
                t = next(given)
                if t.dtype != dtype or list(t.shape) != list(shape):
                    raise NormswapError(f"internal: {key} is {t.dtype} {list(t.shape)}, "
                                        f"planned {dtype} {list(shape)}")
                if t.numel():  # the tensor's own bytes, no copy
                    f.write(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().data)
                del t
    # Run a generator to its end: code after its last yield frees what it read for that tensor.
    if next(given, None) is not None:
        raise NormswapError("internal: more tensors than planned")
    if len(names) > 1:
        index = {"metadata": {"total_size": total_bytes(specs)}, "weight_map": weight_map}
        (out / checksum.with_variant(INDEX, variant)).write_text(json.dumps(index, indent=2) + "\n")
    return names


def aliases(model: nn.Module) -> dict[str, str]:
    """state_dict name -> the name it is saved under: tied tensors are saved once, under their first name."""
    first: dict[int, str] = {}
    out = {}
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for name, t in named:
        out[name] = first.setdefault(id(t), name)
    return out


def saved_specs(model: nn.Module) -> list[tuple[str, torch.dtype, list[int]]]:
    """(name, dtype, shape) of what `save_model` writes, in state_dict order (works on meta models)."""
    alias = aliases(model)
    return [(k, v.dtype, list(v.shape)) for k, v in model.state_dict().items() if alias.get(k, k) == k]


def save_model(model: nn.Module, out: str | Path, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
               tensors: Iterable[torch.Tensor] | None = None, names: dict[str, str] | None = None,
               variant: str | None = None) -> list[str]:
    """Write `model`'s state (tied tensors once) to folder `out`, sharded above max_shard_size, as `variant`;
    `tensors`, if given, are the values to write in `saved_specs(model)` order (computed as they are written);
    `names`: state name -> the key to write it under, where that differs."""
    specs = saved_specs(model)
    check_space(out, total_bytes(specs))
    if tensors is None:
        state = model.state_dict()
        tensors = (state[k] for k, _, _ in specs)
    return write(out, [((names or {}).get(k, k), dt, shape) for k, dt, shape in specs], tensors, max_shard_size,
                 variant)


def check_space(out: str | Path, needed: int) -> None:
    """Refuse before writing, not after an hour: a 40B model's shards fill a disk that its config fits on.
    `out` need not exist yet: the space is measured at its nearest existing folder, where it will land."""
    where = Path(out).expanduser().absolute()
    while not where.exists():
        where = where.parent
    # a read-only mount reports no free space: say what is wrong instead
    if hasattr(os, "statvfs") and os.statvfs(where).f_flag & os.ST_RDONLY:
        raise NormswapError(f"cannot write to {where}: it is on a read-only file system; nothing was written")
    free = shutil.disk_usage(where).free
    if needed > free:
        raise NormswapError(f"not enough disk space in {Path(out).parent}: the weights need {human(needed)}, "
                            f"{human(free)} are free; nothing was written")
