"""Converted folders loaded where normswap cannot be imported: plain transformers in a child interpreter (this
one's, or NORMSWAP_PLAIN_PYTHON's, the other major version), compared to the original. Shared by
tests/models/test_shipped.py (every exact family the tests convert) and test_renamed.py (transformers 5's
renamed families)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from copy import deepcopy
from pathlib import Path

import torch
import transformers
from torch import nn

import normswap
from normswap.errors import NormswapError
from normswap.models.inputs import sample_inputs
from normswap.parity import main_output

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
        auto = sorted(k for k, v in config["auto_map"].items() if k != "AutoConfig" and v.endswith("." + arch)
                      and hasattr(transformers, k))   # one this transformers has (AutoModelForMultimodalLM: 5.x)
        auto = auto[0] if auto else None
    else:                      # an original: its own class
        auto = arch
    try:
        if auto is None:
            raise LookupError(f"its auto_map offers no Auto class for {arch}")
        model, info = getattr(transformers, auto).from_pretrained(folder, trust_remote_code=True,
                                                                  output_loading_info=True)
        if info["missing_keys"]:   # transformers initialises them at random: not the model saved
            raise ValueError(f"weights missing: {sorted(info['missing_keys'])[:3]}")
        model.eval()
        outputs = []
        with torch.no_grad():
            for batch in (torch.load(inputs_file) if inputs_file != "-" else []):
                out = {}
                flat(model(**batch), "", out)
                outputs.append(out)
    except Exception as e:   # refused, or (another major version's) fails on these inputs
        results[folder] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        continue
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


TOLERANCE = 1e-5   # a load's main output against the original's, relative to its largest value


def rounding(model: nn.Module, inputs: list[dict], want: list[torch.Tensor]) -> float:
    """How far the original's main output in float32 (`want`) is from a float64 copy's, relative to its largest
    value: the model's own rounding, which an exact conversion (other float32 arithmetic) may differ by too."""
    def wide(x):
        return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
    try:
        copy = deepcopy(model).double()
        with torch.no_grad():
            exact = [main_output(copy(**{k: wide(v) for k, v in batch.items()}))[1] for batch in inputs]
    except Exception:   # a model that does not run in float64
        return 0.0
    scale = max(ref.abs().max().item() for ref in exact)
    return max((a - b).abs().max().item() for a, b in zip(want, exact)) / scale


def convert_all(root: Path, cases: dict[str, Callable], extra_inputs: dict | None = None) -> dict:
    """Each case built, converted exactly and saved under `root` by normswap (<name>) and by transformers' own
    save path (<name>-own), its inputs beside (<name>-inputs.pt), the original too under the other major version
    (<name>-original); {name: (folder, inputs, the original's main outputs on them, taken before, the tolerance
    of a load's: TOLERANCE, or 4 times the model's own float32 rounding where that is larger)}."""
    out = {}
    for name, make in cases.items():
        torch.manual_seed(0)
        model = make()
        inputs = sample_inputs(model) + (extra_inputs or {}).get(name, [])
        with torch.no_grad():
            want = [main_output(model(**batch))[1].double() for batch in inputs]
        tolerance = max(TOLERANCE, 4 * rounding(model, inputs, want))
        if OTHER_VERSION:   # what the other version's own original gives is what the converted folder must give
            model.save_pretrained(root / f"{name}-original")
        report = normswap.convert(model, method="exact")
        assert report.method == "exact" and report.verification["enforced"], name
        normswap.save_pretrained(model, root / name)
        model.save_pretrained(root / f"{name}-own")   # transformers' own save path, on the converted model
        torch.save(inputs, root / f"{name}-inputs.pt")
        out[name] = (root / name, inputs, want, tolerance)
    return out


def check_loads(root: Path, cases: dict) -> list[str]:
    """`convert_all`'s folders (both saves) loaded in plain transformers in one child (`plain_transformers`) and,
    under this major version, in normswap; every way one differs from the original, or loads where the other
    version's original does not, in a line. The main output (logits, else last_hidden_state, else the first)
    must be the original's to the case's tolerance (`convert_all`) of its largest value; under this major
    version every floating output of plain transformers' load must be normswap's load's to 2e-6 (one
    implementation)."""
    jobs = {str(folder): str(root / f"{name}-inputs.pt") for name, (folder, *_) in cases.items()}
    if OTHER_VERSION:
        jobs.update({f"{folder}-original": inputs for folder, inputs in list(jobs.items())})
    jobs.update({f"{folder}-own": str(root / f"{name}-inputs.pt") for name, (folder, *_) in cases.items()})
    got = plain_transformers(root, jobs)
    failures = []
    saves = [(name, folder, folder, *case) for name, (folder, *case) in cases.items()]
    saves += [(f"{name} (own save)", Path(f"{folder}-own"), folder, *case)   # transformers' own save path
              for name, (folder, *case) in cases.items()]
    for name, folder, base, inputs, want, tolerance in saves:
        res = got[str(folder)]
        if OTHER_VERSION and "error" in got[f"{base}-original"]:   # its original does not load there either:
            if "error" not in res:                                   # the converted folder must be refused too
                failures.append(f"{name}: loads where its original does not ({got[f'{base}-original']})")
            continue
        if OTHER_VERSION:   # that version's own original (ESM's differs from 5.x's on padded rows)
            ours_want = want
            want = [next(o for k, o in outputs.items() if k in ("logits", "last_hidden_state")) if any(
                k in outputs for k in ("logits", "last_hidden_state")) else next(iter(outputs.values()))
                for outputs in torch.load(f"{base}-original-plain.pt")]
            # where that version computes another function than this one's for the same weights (PhiMoE, Aria),
            # the fingerprint recorded here may refuse the folder there: a refusal, not another model
            changed = max((a.double() - b).abs().max().item() for a, b in zip(want, ours_want)) / max(
                b.abs().max().item() for b in ours_want) > tolerance
            if changed and "FingerprintMismatch" in res.get("error", ""):
                continue
        if "error" in res:
            # no Auto class builds this class in transformers itself (a text tower alone): plain transformers'
            # users load it by its class, which the weights variant refuses loudly (tests/models/test_own_save.py)
            unmapped = res["error"].startswith("LookupError: its auto_map offers no Auto class") and \
                set(json.loads((folder / "config.json").read_text())["auto_map"]) == {"AutoConfig"}
            if not unmapped:
                failures.append(f"{name}: {res['error']}")
            continue
        assert res["cls"].startswith("Normswap"), name
        plain = torch.load(f"{folder}-plain.pt")
        try:
            ours = None if OTHER_VERSION else normswap.from_pretrained(folder)
        except NormswapError as e:   # refused in normswap: said, and the other folders still checked
            failures.append(f"{name}: normswap refuses it ({str(e).splitlines()[0][:300]})")
            continue
        # relative to the output's largest value over all batches: one batch's near-cancelling value (CLIP's
        # 64-token row: a cosine of 0.005) would make a 1-ulp difference look large
        scale = max(ref.abs().max().item() for ref in want)
        mines = []
        for batch, ref, outputs in zip(inputs, want, plain):
            # the main output (logits, else last_hidden_state, else the first) is the original's ...
            key = next((k for k in ("logits", "last_hidden_state") if k in outputs), next(iter(outputs)))
            off = (outputs[key].double() - ref).abs().max().item() / scale
            if off > tolerance:
                failures.append(f"{name}: {key} off by {off:.3g} against the original (tolerance {tolerance:.3g})")
            # ... and every floating output is what normswap's own load gives (one implementation; under the
            # other major version the output structures differ: the main output only, normswap's load checked
            # by the run under this one)
            if ours is None:
                continue
            with torch.no_grad():
                result = ours(**batch)
            mines.append({})
            flat(result, "", mines[-1])  # noqa: F821 (defined by exec)
            assert mines[-1].keys() == outputs.keys(), name
            off = (main_output(result)[1].double() - ref).abs().max().item() / scale
            if off > tolerance:
                failures.append(f"{name}: normswap's load off by {off:.3g} against the original "
                                f"(tolerance {tolerance:.3g})")
        # each output relative to its largest value over the batches, as above
        # (a batch's outputs may have fields another's lack: Gemma3's image_outputs with pixels only)
        scales = {k: max(m[k].abs().max().item() for m in mines if k in m) for m0 in mines for k in m0}
        failures += [f"{name}: {k} off by {off:.3g} against normswap's load" for mine, outputs in zip(mines, plain)
                     for k in mine if (off := (outputs[k] - mine[k]).abs().max().item() / max(scales[k], 1e-30)) > 2e-6]
    return failures
