"""Self-describing converted folders: config.json names a modeling file that transformers runs.

save_pretrained calls `make_self_describing`: the folder gets `modeling_normswap.py` (template.py plus
generated subclasses of the original config and model classes) and config.json gets
model_type "normswap_<original>", `architectures` and `auto_map` naming those subclasses, the original
model_type and architectures kept in the normswap section under "original". So
`AutoModelFor...from_pretrained(folder, trust_remote_code=True)` rebuilds the converted model without
normswap, and without trust_remote_code transformers refuses (unknown model_type with custom code)
instead of loading a LayerNorm model with the converted weights.

normswap itself never runs that file: `load_config` maps the folder back to the original config class,
so io.from_pretrained builds the original architecture and applies the section with its own modules.
"""
from __future__ import annotations

import json
from pathlib import Path

import transformers
from transformers.models.auto import modeling_auto

from normswap.errors import NormswapError

MODELING_FILE = "modeling_normswap.py"
TEMPLATE = Path(__file__).with_name("template.py")
PREFIX = "normswap_"


def auto_classes(model_type: str, arch: str) -> dict[str, str]:
    """{Auto class: arch} for the Auto classes that build `arch` for `model_type` (AutoModel for a base model).

    A base model is not offered for a model with a head: its tied embedding may be stored under the head's
    name only (safetensors keeps one name per tensor), so it would load incomplete."""
    out = {}
    for name in dir(modeling_auto):
        mapping = getattr(getattr(modeling_auto, name), "_model_mapping", None)
        if name.startswith("AutoModel") and mapping is not None:
            if getattr(mapping, "_model_mapping", {}).get(model_type) == arch:
                out[name] = arch
    return out


def modeling_source(config_cls: str, model_type: str, classes: list[str]) -> str:
    """template.py followed by the subclasses for this model."""
    lines = [f"from transformers import {', '.join(sorted({config_cls, *classes}))}  # noqa: E402", "", "",
             f"class Normswap{config_cls}({config_cls}):", f'    model_type = "{PREFIX}{model_type}"', ""]
    for cls in sorted(set(classes)):
        lines += ["", f"class Normswap{cls}(NormswapMixin, {cls}):", f"    config_class = Normswap{config_cls}", ""]
    return TEMPLATE.read_text() + "\n".join(lines)


def make_self_describing(folder: Path, model) -> None:
    """Rewrite folder/config.json (saved from model.config) to load through modeling_normswap.py."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    if not config.get("normswap"):
        return  # nothing converted: the folder is a plain transformers model
    base_type = model.config.model_type.removeprefix(PREFIX)
    # A model loaded through the modeling file has the generated subclasses: save their originals.
    arch, config_cls = (type(x).__name__ for x in (model, model.config))
    arch, config_cls = (n if hasattr(transformers, n) else n.removeprefix("Normswap") for n in (arch, config_cls))
    if not hasattr(transformers, arch) or not hasattr(transformers, config_cls):
        return  # not a transformers class: nothing the modeling file could rebuild
    classes = auto_classes(base_type, arch)
    config["normswap"]["original"] = {"model_type": base_type, "architectures": [arch]}
    config["model_type"] = PREFIX + base_type
    config["architectures"] = [f"Normswap{arch}"]
    config["auto_map"] = {"AutoConfig": f"{MODELING_FILE[:-3]}.Normswap{config_cls}",
                          **{a: f"{MODELING_FILE[:-3]}.Normswap{c}" for a, c in sorted(classes.items())}}
    (folder / MODELING_FILE).write_text(modeling_source(config_cls, base_type, [arch]))
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def load_config(where: str, **kwargs):
    """The original transformers config of a folder or Hub id, old or new normswap layout, without
    running any code from it. kwargs go to `get_config_dict` (local_files_only, revision...)."""
    config_dict, _ = transformers.PretrainedConfig.get_config_dict(where, **kwargs)
    original = (config_dict.get("normswap") or {}).get("original")
    if not original:
        return transformers.AutoConfig.from_pretrained(where, trust_remote_code=False, **kwargs)
    config_dict = {k: v for k, v in config_dict.items() if k != "auto_map"}
    config_dict["model_type"], config_dict["architectures"] = original["model_type"], original["architectures"]
    config_dict["normswap"] = {k: v for k, v in config_dict["normswap"].items() if k != "original"}
    if original["model_type"] not in transformers.CONFIG_MAPPING:
        raise NormswapError(f"{where}: model type '{original['model_type']}' (config.json normswap.original) "
                            f"is unknown to transformers {transformers.__version__}")
    return transformers.CONFIG_MAPPING[original["model_type"]].from_dict(config_dict)
