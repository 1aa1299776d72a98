"""One implementation of a saved conversion (issue 18.2): the modeling_normswap.py every converted folder ships
is `normswap/folder/portable.py` verbatim, the module normswap itself rebuilds folders with; and plain
transformers, with normswap unimportable, loads every exact family the tests convert as the original model."""
from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch

import normswap
from normswap.folder import checksum, fingerprint, modeling, portable, shipped, fixes

from helpers.exact_models import FAMILIES, build, perturb
from helpers.plain import OTHER_VERSION, check_loads, convert_all, plain_transformers
from helpers.reload_models import MAKERS
from surgery.test_trace import MODELS

pytestmark = pytest.mark.slow   # every exact family converted, then loaded in a child process

# Every exact family the tests convert: exact_models', the traced ones and the plans with input fixes.
CASES = {**{name: (lambda n=name: build(n)) for name in FAMILIES},
         **{f"traced-{name}": (lambda m=make: perturb(m()).eval()) for name, (make, _) in MODELS.items()},
         **{name: (lambda m=make: perturb(m()).eval()) for name, make in MAKERS.items()}}
EXTRA_INPUTS = {f"traced-{name}": inputs if isinstance(inputs, list) else [inputs]   # other shapes than the samples
                for name, (_, inputs) in MODELS.items()}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Every case converted exactly and saved; the original's main outputs on its inputs, taken before."""
    root = tmp_path_factory.mktemp("shipped")
    return root, convert_all(root, CASES, EXTRA_INPUTS)


def test_shipped_file_is_the_shipped_modules_verbatim(converted):
    root, cases = converted
    first, *rest = [Path(m.__file__).read_text() for m in (portable, fixes, checksum, fingerprint, shipped)]
    expected = "\n\n".join([first] + [text[text.index(modeling.SHIPPED_FROM):] for text in rest]) + modeling.GENERATED
    for folder, *_ in cases.values():
        for saved in (folder, Path(f"{folder}-own")):
            assert (saved / modeling.MODELING_FILE).read_text().startswith(expected), saved.name
    # It imports the standard library, torch and transformers only: never normswap.
    tree = ast.parse(modeling.shipped_source())
    imported = {(n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
                for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in (n.names if isinstance(n, ast.Import) else [n])}
    assert imported <= {"__future__", "contextlib", "functools", "hashlib", "importlib", "inspect", "json", "math",
                        "os", "re", "shutil", "struct", "sys", "warnings", "pathlib", "torch", "transformers"}
    # One namespace: no module's name hides another's (a shared `digest` once broke every section's hash).
    names = [t.id if isinstance(t, ast.Name) else t.name for node in tree.body
             for t in (node.targets if isinstance(node, ast.Assign) else [node])
             if isinstance(t, (ast.Name, ast.FunctionDef, ast.ClassDef))]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    # And normswap rebuilds folders with it: the fixes the conversion installs are its functions.
    from normswap.surgery import centring
    assert centring.add_input_fix is fixes.add_input_fix and centring.add_output_fix is fixes.add_output_fix


def test_every_exact_family_loads_in_plain_transformers_as_the_original(converted, monkeypatch):
    # normswap's side runs the shipped file's arithmetic (the fused CPU kernel rounds differently, ~1 ulp),
    # so any difference left is the rebuild's, not the norm kernel's
    monkeypatch.setenv("NORMSWAP_BACKEND", "torch")
    failures = check_loads(*converted)
    assert not failures, failures


def test_a_hand_edited_section_or_other_weights_are_refused_in_plain_transformers(converted, tmp_path):
    root, cases = converted
    source = cases["traced-whisper"][0]
    edited = Path(shutil.copytree(source, tmp_path / "edited"))
    config = json.loads((edited / "config.json").read_text())
    norm = next(iter(config["normswap"]["norms"]))
    config["normswap"]["norms"][norm]["eps"] *= 10
    (edited / "config.json").write_text(json.dumps(config))
    swapped = Path(shutil.copytree(source, tmp_path / "swapped"))
    state = safetensors.torch.load_file(swapped / "model.normswap.safetensors")
    state[f"{norm}.weight"] = state[f"{norm}.weight"].half()   # same names and shapes: another file
    safetensors.torch.save_file(state, swapped / "model.normswap.safetensors", metadata={"format": "pt"})
    got = plain_transformers(tmp_path, {str(edited): "-", str(swapped): "-"})
    assert "edited after normswap saved it" in got[str(edited)]["error"]
    assert "are not the ones saved with this config" in got[str(swapped)]["error"]
    with pytest.raises(normswap.NormswapError, match="edited after normswap saved it"):
        normswap.from_pretrained(edited)


def test_a_folder_saved_before_input_fixes_shipped_is_named(converted, tmp_path, capsys):
    """Folders written by earlier releases carry a modeling_normswap.py without input fixes: normswap loads
    them right, and says that plain transformers would not."""
    root, cases = converted
    folder = Path(shutil.copytree(cases["m2m100"][0], tmp_path / "old"))
    normswap.from_pretrained(folder)
    assert "predates input fixes" not in capsys.readouterr().err
    text = (folder / modeling.MODELING_FILE).read_text()
    (folder / modeling.MODELING_FILE).write_text(text.replace("def add_input_fix", "def gone"))
    normswap.from_pretrained(folder)
    assert "predates input fixes" in capsys.readouterr().err


def test_the_fingerprint_refuses_what_the_old_shipped_code_loaded_wrong(converted, tmp_path):
    """Issue 46: the shipped code before the fingerprint registered no renaming for VideoMAE's q_bias / v_bias,
    which transformers 5.24 renames to query.bias / value.bias on load; so the generated class loaded those at
    random (0.30 off), silently. With that code planted back, the load is refused by the fingerprint alone."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    if OTHER_VERSION or not get_checkpoint_conversion_mapping("videomae"):
        pytest.skip("this transformers does not rename VideoMAE's tensors")
    root, cases = converted
    folder = Path(shutil.copytree(cases["videomae-pretrain"][0], tmp_path / "old-code"))
    text = (folder / modeling.MODELING_FILE).read_text()
    head = "def register_base_mapping(class_name: str, section: dict) -> None:\n"
    assert text.count(head) == 1
    (folder / modeling.MODELING_FILE).write_text(text.replace(head, head + "    return   # the old code\n"))
    got = plain_transformers(tmp_path, {str(folder): "-"})
    assert "does not reproduce the outputs recorded when it was saved" in got[str(folder)]["error"]


def test_weights_of_the_same_layout_copied_over_are_refused_in_plain_transformers(converted, tmp_path):
    """The checksum hashes the headers: values changed under the same header pass it (the hostile probe's OLMo
    folder with the original's weights copied over). The fingerprint refuses them, in plain transformers too."""
    root, cases = converted
    folder = Path(shutil.copytree(cases["gpt2"][0], tmp_path / "same-header"))
    file = folder / "model.normswap.safetensors"
    raw = bytearray(file.read_bytes())
    start = 8 + int.from_bytes(raw[:8], "little")
    values = torch.frombuffer(raw, dtype=torch.float32, offset=start)
    values.mul_(1 + 0.1 * torch.randn_like(values))
    file.write_bytes(bytes(raw))
    got = plain_transformers(tmp_path, {str(folder): "-"})
    assert "does not reproduce the outputs recorded when it was saved" in got[str(folder)]["error"]
    with pytest.raises(normswap.NormswapError, match="does not reproduce the outputs recorded"):
        normswap.from_pretrained(folder)
