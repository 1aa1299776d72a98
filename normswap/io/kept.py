"""What a folder converted or exported from SRC keeps of it: every file its loaders read that the conversion does
not change, copied verbatim (`copy_kept`), before normswap writes its own files over the ones it rewrites.

Kept: SRC's top-level files (tokenizer files, the slow tokenizer's vocab.txt / merges.txt / *.model included,
generation and processor settings, sentence-transformers' modules.json, sentence_bert_config.json and
config_sentence_transformers.json, the model card) and the module folders modules.json names (Pooling, Dense,
Normalize), listed in OUT's config.json (KEY). Not kept: what normswap writes itself (config.json, the weights,
modeling_normswap.py, its logs), the model in other forms (weights of any format, Python code, a PEFT adapter),
hidden files, and other folders (onnx/, openvino/: exports of the original model). A kept file that is a link to
outside SRC is refused, as weights outside SRC are: OUT takes no file from elsewhere (a Hub snapshot's files
may point into its own blobs/).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from normswap.errors import NormswapError

KEY = "normswap_kept"       # config.json: what was kept, so that `overwrite` knows these files as normswap's
MODULES = "modules.json"   # sentence-transformers: the modules of the pipeline, each in its folder
NOT_KEPT = frozenset({"config.json", "normswap.json", "modeling_normswap.py", "heal_log.json", "genai_config.json",
                      "adapter_config.json"})
MODEL_FORMS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".onnx.data",
               ".onnx_data", ".gguf", ".index.json", ".py", ".lock")


def kept_name(name: str) -> bool:
    """Whether a top-level file called `name` is kept."""
    return not (name in NOT_KEPT or name.startswith(".") or name.endswith(MODEL_FORMS))


def module_folders(folder: Path) -> list[str]:
    """The folders modules.json names, as written there (its Transformer module, path "", is the folder itself)."""
    try:
        modules = json.loads((Path(folder) / MODULES).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return []
    paths = [m.get("path") for m in modules if isinstance(m, dict)] if isinstance(modules, list) else []
    return sorted({p.strip("/") for p in paths if isinstance(p, str) and p.strip("/")})


def kept(folder: str | Path) -> list[str]:
    """The files of `folder` a folder converted or exported from it keeps (paths relative to it, sorted)."""
    folder = Path(folder)
    top = [e.name for e in folder.iterdir() if kept_name(e.name) and e.is_file()]
    inner = [str(f.relative_to(folder)) for d in module_folders(folder) if (folder / d).is_dir()
             for f in (folder / d).rglob("*") if f.is_file()]
    return sorted(top + inner)


def check_inside(folder: Path, name: str) -> None:
    """Refuse `folder`/`name` where it (or a folder on its way) resolves outside `folder` (or, for a Hub
    snapshot, outside the repository's blobs/)."""
    root = folder.resolve()
    roots = [root] + ([root.parent.parent / "blobs"] if root.parent.name == "snapshots" else [])
    real = (folder / name).resolve()
    if not any(real == r or r in real.parents for r in roots):
        raise NormswapError(f"{folder}/{name} is a link to {real}, outside {folder}: refusing to copy a file from "
                            "elsewhere into the output (copy it into the folder if it belongs to the model)")


def copy_kept(src: str | Path, dest: Path) -> list[str]:
    """Copy `kept(src)` into `dest` (and the module folders modules.json names, even empty: Normalize has no
    files); every one checked first, so a refused link leaves nothing half-copied. Returns the names, folders
    included."""
    src = Path(src)
    names = kept(src)
    for name in names:
        check_inside(src, name)
    for d in module_folders(src):
        check_inside(src, d)
        (dest / d).mkdir(parents=True, exist_ok=True)
    for name in names:
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / name, dest / name)
    return sorted({*names, *module_folders(src)})


def record(dest: Path, names: list[str]) -> None:
    """List the kept `names` in dest/config.json (under KEY; none: no key)."""
    path = Path(dest) / "config.json"
    config = json.loads(path.read_text())
    config.pop(KEY, None)
    if names:
        config[KEY] = names
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def recorded(config: dict) -> set[str]:
    """The entries of a folder whose config.json is `config` that were kept from its source (files and the
    top folders they are in)."""
    names = config.get(KEY) if isinstance(config, dict) else None
    names = [n for n in names if isinstance(n, str)] if isinstance(names, list) else []
    return {n.split("/")[0] for n in names}
