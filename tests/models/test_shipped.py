"""One implementation of a saved conversion (issue 18.2): the modeling_normswap.py every converted folder ships
is `normswap/io/portable.py` verbatim, the module normswap itself rebuilds folders with; and plain
transformers, with normswap unimportable, loads every exact family the tests convert as the original model."""
from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
import transformers

import normswap
from normswap.io import checksum, fingerprint, portable, shipped
from normswap.models import hub
from normswap.models.inputs import sample_inputs
from normswap.parity import main_output

from helpers.exact_models import FAMILIES, build, perturb
from helpers.reload_models import MAKERS
from surgery.test_trace import MODELS

pytestmark = pytest.mark.slow   # every exact family converted, then loaded in a child process

# Every exact family the tests convert: exact_models', the traced ones and the plans with input fixes.
CASES = {**{name: (lambda n=name: build(n)) for name in FAMILIES},
         **{f"traced-{name}": (lambda m=make: perturb(m()).eval()) for name, (make, _) in MODELS.items()},
         **{name: (lambda m=make: perturb(m()).eval()) for name, make in MAKERS.items()}}
EXTRA_INPUTS = {f"traced-{name}": inputs if isinstance(inputs, list) else [inputs]   # other shapes than the samples
                for name, (_, inputs) in MODELS.items()}

# Every floating tensor of a model's output, by path (defined once: the child below runs it too).
FLAT = '''
def flat(x, name, out):
    if isinstance(x, torch.Tensor):
        if x.is_floating_point():
            out[name] = x.detach().double()
    elif isinstance(x, dict):   # a ModelOutput too
        for k, v in x.items():
            flat(v, f"{name}.{k}" if name else k, out)
    elif isinstance(x, (tuple, list)):
        for i, v in enumerate(x):
            flat(v, f"{name}.{i}", out)
'''
exec(FLAT)

# Runs where normswap cannot be imported: poisoned in sys.modules, refused by a meta-path finder, the
# repository off the path and the working directory elsewhere. Loads each folder with the Auto class its
# auto_map offers for its architecture and writes every floating output on the given inputs.
CHILD = r'''
import importlib.abc, json, sys
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "normswap" or name.startswith("normswap."):
            raise ImportError("normswap is blocked here")
sys.meta_path.insert(0, Blocker())
sys.modules["normswap"] = None
import torch, transformers
jobs, results = json.load(open(sys.argv[1])), {}
''' + FLAT + r'''

for folder, inputs_file in jobs.items():
    config = json.load(open(folder + "/config.json"))
    arch = config["architectures"][0]
    if "auto_map" in config:   # a converted folder: the Auto class its auto_map offers
        auto = sorted(k for k, v in config["auto_map"].items() if k != "AutoConfig" and v.endswith("." + arch))[0]
    else:                      # an original: its own class
        auto = arch
    try:
        model, info = getattr(transformers, auto).from_pretrained(folder, trust_remote_code=True,
                                                                  output_loading_info=True)
        if info["missing_keys"]:   # transformers initialises them at random: not the model saved
            raise ValueError(f"weights missing: {sorted(info['missing_keys'])[:3]}")
        model.eval()
    except Exception as e:
        results[folder] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        continue
    outputs = []
    with torch.no_grad():
        for batch in torch.load(inputs_file):
            out = {}
            flat(model(**batch), "", out)
            outputs.append(out)
    torch.save(outputs, folder + "-plain.pt")
    results[folder] = {"cls": type(model).__name__, "auto": auto}
results["transformers"] = transformers.__version__
json.dump(results, open("results.json", "w"))
'''


# The interpreter that loads the folders: this one, or NORMSWAP_PLAIN_PYTHON's (a venv with the other transformers
# major version, 4.57: CI runs this file again with it; the folders load there as in transformers 5).
PLAIN_PYTHON = os.environ.get("NORMSWAP_PLAIN_PYTHON", sys.executable)
OTHER_VERSION = PLAIN_PYTHON != sys.executable


def plain_transformers(tmp_path: Path, jobs: dict[str, str]) -> dict:
    """Load each folder in a fresh interpreter that cannot import normswap; {folder: result}."""
    (tmp_path / "child.py").write_text(CHILD)
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    proc = subprocess.run([PLAIN_PYTHON, "child.py", "jobs.json"], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]   # a broken NORMSWAP_PLAIN_PYTHON fails, never skips
    results = json.loads((tmp_path / "results.json").read_text())
    ours = int(transformers.__version__.split(".")[0])
    # the other major version where one was asked for (4.x beside our 5.x), else this very one
    assert (int(results.pop("transformers").split(".")[0]) != ours) == OTHER_VERSION, PLAIN_PYTHON
    return results


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Every case converted exactly and saved; the original's main outputs on its inputs, taken before."""
    root = tmp_path_factory.mktemp("shipped")
    out = {}
    for name, make in CASES.items():
        torch.manual_seed(0)
        model = make()
        inputs = sample_inputs(model) + EXTRA_INPUTS.get(name, [])
        with torch.no_grad():
            want = [main_output(model(**batch))[1].double() for batch in inputs]
        if OTHER_VERSION:   # what the other version's own original gives is what the converted folder must give
            model.save_pretrained(root / f"{name}-original")
        report = normswap.convert(model, method="exact")
        assert report.method == "exact" and report.verification["enforced"], name
        normswap.save_pretrained(model, root / name)
        model.save_pretrained(root / f"{name}-own")   # transformers' own save path, on the converted model
        torch.save(inputs, root / f"{name}-inputs.pt")
        out[name] = (root / name, inputs, want)
    return root, out


def test_shipped_file_is_the_shipped_modules_verbatim(converted):
    root, cases = converted
    first, *rest = [Path(m.__file__).read_text() for m in (portable, checksum, fingerprint, shipped)]
    expected = "\n\n".join([first] + [text[text.index(hub.SHIPPED_FROM):] for text in rest]) + hub.GENERATED
    for folder, _, _ in cases.values():
        for saved in (folder, Path(f"{folder}-own")):
            assert (saved / hub.MODELING_FILE).read_text().startswith(expected), saved.name
    # It imports the standard library, torch and transformers only: never normswap.
    tree = ast.parse(hub.shipped_source())
    imported = {(n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
                for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in (n.names if isinstance(n, ast.Import) else [n])}
    assert imported <= {"__future__", "contextlib", "hashlib", "importlib", "inspect", "json", "math", "os", "re",
                        "shutil", "struct", "sys", "warnings", "pathlib", "torch", "transformers"}
    # One namespace: no module's name hides another's (a shared `digest` once broke every section's hash).
    names = [t.id if isinstance(t, ast.Name) else t.name for node in tree.body
             for t in (node.targets if isinstance(node, ast.Assign) else [node])
             if isinstance(t, (ast.Name, ast.FunctionDef, ast.ClassDef))]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    # And normswap rebuilds folders with it: the hooks the conversion installs are its functions.
    from normswap.surgery import centring
    assert centring.add_input_fix is portable.add_input_fix and centring.add_output_fix is portable.add_output_fix


def test_every_exact_family_loads_in_plain_transformers_as_the_original(converted, monkeypatch):
    # normswap's side runs the shipped file's arithmetic (the fused CPU kernel rounds differently, ~1 ulp),
    # so any difference left is the rebuild's, not the norm kernel's
    monkeypatch.setenv("NORMSWAP_BACKEND", "torch")
    root, cases = converted
    jobs = {str(folder): str(root / f"{name}-inputs.pt") for name, (folder, _, _) in cases.items()}
    if OTHER_VERSION:
        jobs.update({f"{folder}-original": inputs for folder, inputs in list(jobs.items())})
    jobs.update({f"{folder}-own": str(root / f"{name}-inputs.pt") for name, (folder, _, _) in cases.items()})
    got = plain_transformers(root, jobs)
    failures = []
    saves = [(name, folder, folder, inputs, want) for name, (folder, inputs, want) in cases.items()]
    saves += [(f"{name} (own save)", Path(f"{folder}-own"), folder, inputs, want)   # transformers' own save path
              for name, (folder, inputs, want) in cases.items()]
    for name, folder, base, inputs, want in saves:
        res = got[str(folder)]
        if OTHER_VERSION and "error" in got[f"{base}-original"]:   # its original does not load there either:
            if "error" not in res:                                   # the converted folder must be refused too
                failures.append(f"{name}: loads where its original does not ({got[f'{base}-original']})")
            continue
        if OTHER_VERSION:   # that version's own original (ESM's differs from 5.x's on padded rows)
            want = [next(o for k, o in outputs.items() if k in ("logits", "last_hidden_state")) if any(
                k in outputs for k in ("logits", "last_hidden_state")) else next(iter(outputs.values()))
                for outputs in torch.load(f"{base}-original-plain.pt")]
        if "error" in res:
            failures.append(f"{name}: {res['error']}")
            continue
        assert res["cls"].startswith("Normswap"), name
        plain = torch.load(f"{folder}-plain.pt")
        ours = normswap.from_pretrained(folder)
        # relative to the output's largest value over all batches: one batch's near-cancelling value (CLIP's
        # 64-token row: a cosine of 0.005) would make a 1-ulp difference look large
        scale = max(ref.abs().max().item() for ref in want)
        mines = []
        for batch, ref, outputs in zip(inputs, want, plain):
            # the main output (logits, else last_hidden_state, else the first) is the original's ...
            key = next((k for k in ("logits", "last_hidden_state") if k in outputs), next(iter(outputs)))
            off = (outputs[key].double() - ref).abs().max().item() / scale
            if off > 1e-5:
                failures.append(f"{name}: {key} off by {off:.3g} against the original")
            # ... and every floating output is what normswap's own rebuild gives (one implementation; under
            # the other major version the output structures differ, so the main output only)
            if PLAIN_PYTHON != sys.executable:
                continue
            with torch.no_grad():
                mines.append({})
                flat(ours(**batch), "", mines[-1])  # noqa: F821 (defined by exec)
            assert mines[-1].keys() == outputs.keys(), name
        # each output relative to its largest value over the batches, as above
        scales = {k: max(m[k].abs().max().item() for m in mines) for k in (mines[0] if mines else {})}
        failures += [f"{name}: {k} off by {off:.3g} against normswap's load" for mine, outputs in zip(mines, plain)
                     for k in mine if (off := (outputs[k] - mine[k]).abs().max().item() / max(scales[k], 1e-30)) > 1e-6]
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
    text = (folder / hub.MODELING_FILE).read_text()
    (folder / hub.MODELING_FILE).write_text(text.replace("def add_input_fix", "def gone"))
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
    text = (folder / hub.MODELING_FILE).read_text()
    head = "def register_base_mapping(class_name: str, section: dict) -> None:\n"
    assert text.count(head) == 1
    (folder / hub.MODELING_FILE).write_text(text.replace(head, head + "    return   # the old code\n"))
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
