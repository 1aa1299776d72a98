"""A converted module without a transformers config, rebuilt from the folder `save_pretrained` wrote for it
(model.safetensors and normswap.json, its `normswap` section): on a fresh instance of the user's class, the
recorded structure is applied by `fixes.rebuild` (what every converted Hugging Face folder runs), then
the weights are loaded strictly.

    model = GPT()                                # the user's class, built as before converting
    normswap.restore(model, "gpt-rms")           # RMSNorms, added biases, output and input fixes, weights

No code is read from the folder: the class is the caller's. Its name in normswap.json is for information;
what must match is the structure (every module the section names, every tensor name and shape).
"""
from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import torch
from torch import nn

from normswap.errors import NormswapError, first_line
from normswap.io import owned, safetensors
from normswap.folder import checksum, portable, schema, fixes
from normswap.models.introspect import norm_kind
from normswap.models.rebuild import load_weights
from normswap.folder.attached import qualified_name
from normswap.folder.attached import section as model_section
from normswap.folder.attached import set_section
from normswap.norms import build_norm, off_fast_path
from normswap.folder.shipped import original_class


@contextlib.contextmanager
def _record_errors(hint: str = ""):
    """portable's one-line errors, naming normswap.json (they speak of config.json, where HF folders keep the
    section), and `hint` added to any refusal (the class the folder was saved from, where it is another)."""
    try:
        yield
    except portable.InvalidConversion as e:
        raise NormswapError(str(e).replace("config.json", owned.RECORD) + hint) from None
    except NormswapError as e:
        raise type(e)(f"{e}{hint}") from None


def read_record(folder: Path) -> dict:
    """normswap.json of a folder `save_pretrained` wrote for a module (one-line errors otherwise)."""
    if not folder.is_dir():
        raise NormswapError(f"{folder} is not a folder")
    file = folder / owned.RECORD
    if not file.is_file():
        if (folder / "config.json").is_file():
            raise NormswapError(f"{folder} holds a Hugging Face model (config.json), not a module's {owned.RECORD}: "
                                "load it with normswap.from_pretrained(folder)")
        raise NormswapError(f"{folder} was not saved by normswap.save_pretrained (no {owned.RECORD})")
    try:
        record = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise NormswapError(f"{file} cannot be read: {first_line(e, type(e).__name__)}") from None
    if not isinstance(record, dict):
        raise NormswapError(f"{file} is not a normswap record (a JSON object): it holds {json.dumps(record)[:40]}")
    if not safetensors.has_weights(folder):
        raise NormswapError(f"{folder} has no {' nor '.join(safetensors.weights_names(folder))}")
    return record


def _check_fresh(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise NormswapError(f"`model` must be a torch.nn.Module, not {type(model).__name__}")
    meta = next((n for n, t in model.state_dict().items() if t.is_meta), None)
    if meta is not None:
        raise NormswapError(f"the model's weights are on the meta device ({meta}, ...): build it with real "
                            "tensors (or call .to_empty(device=...)) before restoring")
    if model_section(model) is not None or any(hasattr(m, "normswap_centre") or hasattr(m, "normswap_centre_input")
                                               for m in model.modules()):
        raise NormswapError(f"this {original_class(model).__name__} was already converted or restored: restore "
                            "needs a freshly "
                            "built instance of its class, with its original norms")


def _check_norms(model: nn.Module, record: dict, where: str) -> None:
    """Each module the record turns into an RMSNorm is a norm of that width in `model` (else a different class
    would be rebuilt silently: the new norm replaces whatever module has the name)."""
    for name, spec in record["norms"].items():
        module = model.get_submodule(name)
        shape = getattr(module, "normalized_shape", None)
        width = shape[-1] if isinstance(shape, (tuple, list)) and shape else shape
        if norm_kind(module) is None or (isinstance(width, int) and width != spec["width"]):
            raise NormswapError(f"{where}: '{name}' is a {spec['width']}-wide norm in the saved model, but a "
                                f"{type(module).__name__}{f' of width {width}' if width else ''} in this one")


def _strict(where: str):
    """The check `load_weights` runs: every tensor present, expected and of its shape."""
    def some(keys: list[str]) -> str:
        keys = sorted(keys)
        return ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")

    def check(missing, unexpected, mismatched) -> None:
        parts = [f"missing {some(missing)}"] if missing else []
        parts += [f"unexpected {some(unexpected)}"] if unexpected else []
        parts += [f"{k} is {tuple(a)} in the folder, {tuple(b)} in the model" for k, a, b in mismatched[:3]]
        if parts:
            raise NormswapError(f"{where}: the weights do not fit this model: {'; '.join(parts)}")
    return check


def _check_ties(model: nn.Module, folder: Path, where: str) -> None:
    """A tensor `model` shares under several names (a tied head) must not be stored under two of them with
    different values: both would load into the one tensor, and only the last would stay (a different model)."""
    reader, shared = safetensors.Reader(folder), {}
    keys = set(reader.keys())
    for name, first in safetensors.aliases(model).items():
        shared.setdefault(first, []).append(name)
    for names in shared.values():
        stored = [n for n in names if n in keys]
        if any(not torch.equal(reader.get(stored[0]), reader.get(n)) for n in stored[1:]):
            raise NormswapError(f"{where}: this model ties {' and '.join(stored)} (one tensor), which the folder "
                                "stores as different tensors: build the model untied, as it was saved")


def _warn_dtypes(model: nn.Module, folder: Path) -> None:
    reader = safetensors.Reader(folder)
    state = model.state_dict()
    other = sorted({f"{reader.meta(k)[0]} -> {state[k].dtype}".replace("torch.", "") for k in reader.keys()
                    if k in state and reader.meta(k)[0] != state[k].dtype and state[k].is_floating_point()})
    if other:
        print(f"warning: {folder}: weights are cast on loading ({', '.join(other)}): build the model in the dtype "
              "it was saved in for outputs identical to the saved model's", file=sys.stderr)


def restore(model: nn.Module, folder, check_fingerprint: bool = True) -> nn.Module:
    """Rebuild on `model`, a freshly built instance of the user's class (with its original LayerNorms), the
    converted model `save_pretrained` wrote to `folder` (model.safetensors + normswap.json); returns `model`.

    The section is validated against the model and its checksum checked (of itself and of the weights'
    headers); the norms it names must be norms of the recorded width. Then, as `from_pretrained` does for a
    Hugging Face folder (`fixes.rebuild`, one implementation): the RMSNorms (type, eps, p, affine), the
    added biases, the output and input fixes. The weights are loaded strictly: a missing, unexpected or
    wrong-shaped tensor is an error. The section is set as `model.normswap_section`; the train/eval mode is
    left as it was. Outputs are bit-identical to the saved model's when `model` is built in the dtype it was
    saved in (other dtypes are cast, with a warning). A Hugging Face folder loads with `from_pretrained`.
    Once the weights are in, the model must reproduce the fingerprint recorded when the folder was saved (one
    forward of its probe input: another class whose names match, a tie the saved model did not have, are refused;
    `check_fingerprint=False` or NORMSWAP_NO_FINGERPRINT=1 skip it).
    On an error after the structure was applied, `model` is left part-changed: build a new one.
    """
    _check_fresh(model)
    folder = Path(folder).expanduser()
    record, where = read_record(folder), str(folder / owned.RECORD)
    saved = record.get("base", {}).get("architecture") if isinstance(record.get("base"), dict) else None
    this = qualified_name(type(model))
    hint = "" if saved is None or saved.rpartition(".")[2] == type(model).__qualname__.rpartition(".")[2] else \
        f" (the folder was saved from {saved}, this model is a {this})"
    with _record_errors(hint):
        portable.validate(record, where, model)
        checksum.verify_checksum(record, folder, where)   # before the model changes: section and weights' headers
        _check_norms(model, record, where)
        fixes.rebuild(model, record, where, build_norm)
        off_fast_path(model)   # torch's fused encoder layer would compute LayerNorm from the rebuilt norms
        _check_ties(model, folder, where)
        load_weights(model, folder, _strict(where))
        schema.verify_fingerprint(model, record, where, check_fingerprint)
    _warn_dtypes(model, folder)
    set_section(model, record)
    return model
