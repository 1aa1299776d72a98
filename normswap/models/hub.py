"""Self-describing converted folders: config.json names a modeling file that transformers runs.

save_pretrained calls `make_self_describing`: the folder gets `modeling_normswap.py` (hub_template.py plus
generated subclasses of the original config and model classes) and config.json gets
model_type "normswap_<original>", `architectures` and `auto_map` naming those subclasses (the original
class and model_type stay in the normswap section's `base`). So
`AutoModelFor...from_pretrained(folder, trust_remote_code=True)` rebuilds the converted model without
normswap, and without trust_remote_code transformers refuses (unknown model_type with custom code)
instead of loading a LayerNorm model with the converted weights.

normswap itself never runs that file: `rebuild.from_pretrained` builds the class named in `base` from
config.json (ignoring model_type and auto_map) and applies the section with its own modules.
"""
from __future__ import annotations

import json
from pathlib import Path

import transformers
from transformers.models.auto import modeling_auto


MODELING_FILE = "modeling_normswap.py"
TEMPLATE = Path(__file__).with_name("hub_template.py")
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
    """hub_template.py followed by the subclasses for this model."""
    lines = [f"from transformers import {', '.join(sorted({config_cls, *classes}))}  # noqa: E402", "", "",
             f"class Normswap{config_cls}({config_cls}):", f'    model_type = "{PREFIX}{model_type}"', ""]
    for cls in sorted(set(classes)):
        lines += ["", f"class Normswap{cls}(NormswapMixin, {cls}):", f"    config_class = Normswap{config_cls}", ""]
    return TEMPLATE.read_text() + "\n".join(lines)


def make_self_describing(folder: Path, model) -> None:
    """Rewrite folder/config.json (saved from model.config) to load through modeling_normswap.py.

    Only config.json's top level changes: the normswap section (and its checksum) stays as saved."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    base = (config.get("normswap") or {}).get("base")
    if not base:
        return  # nothing converted: the folder is a plain transformers model
    arch, model_type = base["architecture"], base["model_type"]
    config_cls = transformers.CONFIG_MAPPING[model_type] if model_type in transformers.CONFIG_MAPPING else None
    if not hasattr(transformers, arch) or config_cls is None or not hasattr(transformers, config_cls.__name__):
        return  # not a transformers class: nothing the modeling file could rebuild
    classes = auto_classes(model_type, arch)
    module = MODELING_FILE.removesuffix(".py")
    config["model_type"] = PREFIX + model_type
    config["architectures"] = [f"Normswap{arch}"]
    config["auto_map"] = {"AutoConfig": f"{module}.Normswap{config_cls.__name__}",
                          **{a: f"{module}.Normswap{c}" for a, c in sorted(classes.items())}}
    (folder / MODELING_FILE).write_text(modeling_source(config_cls.__name__, model_type, [arch]))
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
