"""The transformers side of every converted folder's modeling_normswap.py, shipped after `portable.py`,
`checksum.py` and `fingerprint.py` from the line `SHIPPED_FROM` on (the imports above it are theirs, which the
file defines). normswap rebuilds its folders with `portable` alone, but a converted model in memory is an instance
of a `NormswapMixin` class too (`models.adopt`), so that transformers' own save path writes a complete folder.

- `NormswapMixin`: first in the bases of the generated classes. Built, it applies the section (`fixes.rebuild`);
  `from_pretrained` reads the "normswap" weights variant, checks the weights' checksum and the fingerprint;
  `save_pretrained` writes that variant, then `finish_folder`: the fingerprint of the model as it is now, the
  checksum, config.json's model_type / architectures / auto_map naming the generated classes, and this file.
- `register_base_mapping`, `peft_defaults`: what transformers 5 and peft look up by class name or model_type,
  which the generated classes do not share with the originals.
"""
from __future__ import annotations

from normswap.folder.checksum import VARIANT, checksum, verify_checksum
from normswap.folder.fingerprint import record, verify
from normswap.folder.portable import FORMAT, InvalidConversion
from normswap.folder.fixes import Fixed, rebuild

# ---- shipped from here: the transformers side -----------------------------------------------------------------
import importlib  # noqa: E402  (the shipped file concatenates modules: each brings its own imports)
import importlib.util  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

PREFIX = "normswap_"   # config.json's model_type: normswap_<the original's>
MODELING_FILE = "modeling_normswap.py"


def reverted(model: nn.Module, keys: list[str] | None = None) -> tuple[dict, dict | None] | None:
    """(meta stand-ins of the model's tensors `keys` (all: None) by state name, what transformers' save writes
    them as, or None where it cannot undo a conversion without the values); None where this transformers has no
    checkpoint conversions."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return None
    state = model.state_dict(keep_vars=True)
    stand_ins = {k: torch.empty(state[k].shape, dtype=state[k].dtype, device="meta")
                 for k in (state if keys is None else keys) if k in state}
    try:
        return stand_ins, revert_weight_conversion(model, dict(stand_ins))
    except Exception:   # a conversion transformers cannot undo without the values (one that makes new tensors)
        return stand_ins, None


def saved_names(model: nn.Module, keys: list[str] | None = None) -> dict[str, str]:
    """State name -> the key transformers' save_pretrained writes it under, for the names that differ (renamed
    tensors only: one that transformers converts, e.g. merged experts, keeps its name here)."""
    from transformers import PreTrainedModel
    found = reverted(model, keys) if isinstance(model, PreTrainedModel) else None
    if found is None or found[1] is None:   # no conversions, or one not undone: saved under the model's names
        return {}
    stand_ins, written = found
    back = {id(t): k for k, t in stand_ins.items()}
    return {back[id(t)]: new for new, t in written.items() if id(t) in back and back[id(t)] != new}


def split_on_save(model: nn.Module, keys: list[str]) -> bool:
    """Whether transformers' save would write some of these tensors as other tensors than renamed copies
    (merged MoE experts split, fused projections unfused): what normswap's loaders do not read."""
    found = reverted(model, keys)
    if found is None:
        return False
    stand_ins, written = found
    return written is None or {id(t) for t in written.values()} != {id(t) for t in stand_ins.values()}


def register_base_mapping(class_name: str, section: dict) -> None:
    """transformers 5 renames a checkpoint's tensors on load and save by the class's or its model_type's
    conversion mapping, but not for custom code: the original architecture's, registered for `class_name` (a
    generated class), so that the folder is read and written under the names transformers uses for the original
    (VideoMAE's q_bias is its query.bias). transformers 4 has no renaming."""
    try:
        from transformers.conversion_mapping import (get_checkpoint_conversion_mapping,
                                                     register_checkpoint_conversion_mapping)
    except ImportError:
        return
    base = section["base"]
    by_class = get_checkpoint_conversion_mapping(base["architecture"])
    mapping = by_class or get_checkpoint_conversion_mapping(base["model_type"])
    # A model_type's mapping goes under model_types (the original's, which a converted model's config keeps in
    # memory, and the folder's, PREFIX + it): registered by class name, it would claim the root by class, and a
    # sub-model of the original's model_type would get the same mapping again (a second renaming: harmless where
    # renaming is idempotent, not where a name's target contains its source, as HY-V4's `hc_` names do).
    for key in [class_name] if by_class else [base["model_type"], PREFIX + base["model_type"]]:
        if mapping:
            register_checkpoint_conversion_mapping(key, mapping, overwrite=True)


def peft_defaults(model_type: str, base: str) -> None:
    """peft picks an adapter's default target modules by model_type: `base`'s for `model_type` too (the modules
    are the same), in every table peft has for `base`. Only where peft is installed; it is not imported otherwise."""
    if importlib.util.find_spec("peft") is None:
        return
    try:
        constants = importlib.import_module("peft.utils.constants")
    except Exception:   # a peft that does not import here: LoRA is not used with this model
        return
    for name, table in vars(constants).items():
        if name.startswith("TRANSFORMERS_MODELS_TO_") and isinstance(table, dict) and base in table:
            table.setdefault(model_type, table[base])


def _folder(path, kwargs: dict) -> Path:
    """The local folder from_pretrained read (a folder, or the Hub cache's snapshot it downloaded)."""
    if os.path.isdir(path):
        return Path(path) / kwargs.get("subfolder", "")
    from transformers.utils import cached_file
    hub = {k: kwargs[k] for k in ("cache_dir", "revision", "subfolder", "token", "local_files_only") if k in kwargs}
    return Path(cached_file(path, "config.json", **hub)).parent


def same_state(model: nn.Module, state_dict: dict | None) -> bool:
    """Whether a state_dict given to save_pretrained holds the model's own values (else the model in memory is
    not what is saved: a sharded training's gathered state, an edited copy)."""
    own = model.state_dict()
    return state_dict is None or all(
        k in own and isinstance(v, torch.Tensor) and own[k].shape == v.shape and torch.equal(own[k].to(v.device), v)
        for k, v in state_dict.items())


def sealed(section: dict, model: nn.Module | None, folder: Path, fingerprint: dict | None = None,
           state_dict: dict | None = None) -> dict:
    """The section as saved beside `folder`'s weights: this format, the fingerprint (given, or recorded from
    `model` on the section's probe), the checksum of itself and of the weights' headers."""
    section = {**section, "format": FORMAT}
    probe = (section.get("fingerprint") or {}).get("probe")
    if fingerprint is not None:
        section["fingerprint"] = fingerprint
    elif probe is not None and model is not None:
        section["fingerprint"] = record(model, probe) if same_state(model, state_dict) else \
            {"probe": probe, "none": "saved from a state_dict other than the model's own values"}
    section["checksum"] = checksum(section, folder)
    return section


def finish_folder(model: nn.Module, folder: Path, code: tuple[str, dict] | None = None,
                  fingerprint: dict | None = None, state_dict: dict | None = None) -> dict:
    """After the weights (the "normswap" variant) and config.json are written: the section sealed (`sealed`),
    config.json naming the generated classes (model_type normswap_<original>, architectures, auto_map: `code`'s,
    or the config's own) and modeling_normswap.py (`code`'s source, or this very file); the section."""
    section = sealed(model.config.normswap, model, folder, fingerprint, state_dict)
    model.config.normswap = section
    path = folder / "config.json"
    config = json.loads(path.read_text())
    base = section["base"]
    config["normswap"] = section
    config["model_type"] = PREFIX + base["model_type"]
    config["architectures"] = [f"Normswap{base['architecture']}"]
    auto_map = code[1] if code else getattr(model.config, "auto_map", None) or config.get("auto_map")
    if auto_map:
        config["auto_map"] = auto_map
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if code:
        (folder / MODELING_FILE).write_text(code[0])
    elif not (folder / MODELING_FILE).is_file():   # a class imported by hand: transformers copied no code
        shutil.copyfile(sys.modules[type(model).__module__].__file__, folder / MODELING_FILE)
    return section


class NormswapMixin:
    """Put first in the bases of a transformers model class: builds it, then applies config.normswap."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        rebuild(self, getattr(config, "normswap", None), getattr(config, "name_or_path", "") or "config.json")
        register_base_mapping(type(self).__name__, config.normswap)
        peft_defaults(config.model_type, config.normswap["base"]["model_type"])

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, normswap_fingerprint: bool = True, **kwargs):
        """transformers' from_pretrained of the "normswap" weights variant, then the checksum of the weights files
        read and the fingerprint (`normswap_fingerprint=False` or NORMSWAP_NO_FINGERPRINT=1 skip the latter)."""
        if kwargs.setdefault("variant", VARIANT) != VARIANT:
            raise InvalidConversion(f"{pretrained_model_name_or_path}: a converted folder's weights are the "
                                    f"'{VARIANT}' variant, not '{kwargs['variant']}'")
        loaded = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        where = str(pretrained_model_name_or_path)
        verify_checksum(model.config.normswap, _folder(pretrained_model_name_or_path, kwargs), where,
                        getattr(model.config, "transformers_weights", None))
        if normswap_fingerprint:
            verify(model, model.config.normswap, where)
        return loaded

    def normswap_code(self) -> tuple[str, dict] | None:
        """The modeling file and auto_map to save (None: transformers copies this class's own file)."""
        return None

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' save of the "normswap" weights variant, then `finish_folder`."""
        if kwargs.get("push_to_hub"):
            raise InvalidConversion("save_pretrained(push_to_hub=True) would upload the folder before normswap "
                                    "completes it: use model.push_to_hub(repo_id), which saves it first")
        if kwargs.get("safe_serialization") is False:
            raise InvalidConversion("a converted model saves as safetensors only (safe_serialization=False)")
        if kwargs.setdefault("variant", VARIANT) != VARIANT:
            raise InvalidConversion(f"a converted model saves its weights as the '{VARIANT}' variant, "
                                    f"not '{kwargs['variant']}'")
        given = kwargs.get("state_dict")
        state = self.state_dict() if given is None else given
        if "save_original_format" in inspect.signature(super().save_pretrained).parameters and \
                split_on_save(self, list(state)):
            # transformers 5 writes a converted checkpoint's tensors back as the original's (merged experts split,
            # fused projections unfused), which loaders of this folder do not read: write them as normswap's own
            # save does (renamed tensors under their names on disk, converted ones as they are in memory)
            names = saved_names(self, list(state))
            kwargs["state_dict"] = {names.get(k, k): v for k, v in state.items()}
            kwargs["save_original_format"] = False
        out = super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            finish_folder(self, Path(save_directory), self.normswap_code(), state_dict=given)
        return out


def original_class(model: nn.Module) -> type:
    """The class `model` was built as: its first class that normswap did not make, neither a converted one nor
    one with fixes in its forward (a fix on the model itself: its input centred)."""
    return next(c for c in type(model).__mro__ if not issubclass(c, (NormswapMixin, Fixed)))
