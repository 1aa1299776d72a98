"""Is the model that comes out the model that went in? Converted models saved and loaded as users do it.

    python benchmarks/loaders.py                              # TYPES and the user rows (~30 min on 2 cores)
    python benchmarks/loaders.py --types gpt2,videomae:VideoMAEForVideoClassification,user:olmo
    python benchmarks/loaders.py --report loaders.jsonl       # the tables of an earlier run

Each type is built tiny and perturbed as `architectures.py` builds it (`TYPE:Class` builds that class of the
type instead of the first its tables give, `TYPE:Class+key=value` with a config setting, a JSON value;
`normswap-demo` is the bundled model, not perturbed), in its own process (`architectures.isolated`). Its
outputs on normswap's sample inputs and on others (batch 3, length 11, another seed) are kept before the
conversion (`normswap.convert(model, method="auto")`) and after it, as references; nothing is deep-copied.
The converted model is then saved by each save path and every folder loaded by each loader; each load runs
the same inputs and every floating output is compared, as normswap's parity check compares (padded positions
left out), to the converted model in memory, and (exact conversions) to the original, leaving out the outputs
the report declares not preserved.

Save paths (columns a, b, c):
  a  normswap.save_pretrained(model, out, tokenizer=None)
  b  model.save_pretrained(out): transformers' own, after normswap.convert(model) in Python
  c  b's folder loaded in plain transformers 5 (as loader 2) and saved again with its save_pretrained
Loaders (1-5b):
  1  normswap.from_pretrained(out)
  2  plain transformers 5 in a process that cannot import normswap: the Auto class config.json's auto_map names
     for its architecture (else the Auto class whose table maps it), trust_remote_code=True
  3  the same in transformers 4.57 (--tf4-python)
  4  the original class by hand: OriginalClass.from_pretrained(out)
  5a fresh_original.load_state_dict(every *.safetensors of out, merged): strict, as written by users
  5b safetensors.torch.load_model(fresh_original, out/model.safetensors)
A control, save path o: the original, saved by transformers 5's save_pretrained before the conversion and loaded
by the same loaders, compared to the original (what each loader gives without normswap: transformers 4.57 reading
transformers 5's renamed checkpoints, load_state_dict and GPT-2's tied head), with `memory`, the converted model
in memory against the original on these inputs.
The user rows (`user:demo`, `user:olmo`: the demo model and a tiny OLMo) take other save paths: Trainer(...)
.save_model(out) and accelerate's Accelerator().save_model(model, out) after a Python convert, torch.save(model)
read back by torch.load in a new process (loader t), and a folder saved by normswap, re-saved by plain
transformers 5, then the original's model.safetensors copied over it (issue 46, item 5).

Outcome per cell: OK (max relative error, max |Δ| / max |reference| per output, <= 1e-4 on every floating
output, against both references), WRONG (loaded without an exception but an output differs: the bug that
must never happen; the error is given), REFUSED (an exception, at save, load or forward: its first line), n/a.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from architectures import TOL, build, isolated, tiny_dict  # noqa: E402

SAVES = {"a": "normswap.save_pretrained", "b": "model.save_pretrained after convert",
         "c": "b loaded and re-saved by plain transformers 5"}
USER_SAVES = {"trainer": "Trainer(...).save_model", "accelerate": "Accelerator().save_model",
              "pickle": "torch.save(model)",
              "resaved-orig": "a re-saved by plain transformers 5, the original's weights copied over it"}
LOADERS = {"1": "normswap.from_pretrained", "2": "transformers 5, trust_remote_code",
           "3": "transformers 4.57, trust_remote_code", "4": "original class .from_pretrained",
           "5a": "load_state_dict (strict) into a fresh original", "5b": "safetensors.torch.load_model",
           "t": "torch.load in a new process"}
FOLDER_LOADERS = ("1", "2", "3", "4", "5a", "5b")
OUTCOMES = ("OK", "WRONG", "REFUSED", "n/a")

# Chosen before the run. architectures.py (main 362820e, transformers 5.24.0) was run on 230 types: those
# transformers 5.24's conversion_mapping.py renames (a model type, or the class of a model or of one of its parts)
# and a spread of the others. Every one of them it converts exactly is here (81: exact 63, exact with some norms
# kept 10, and 8 it found WRONG after a plain transformers reload), then the issue's: the demo, OLMo (its norm
# is not an nn.LayerNorm, which architectures.py counts), BERT (post-LN: naive, compared to its converted model
# only), and classes with an exact form where a type's first class has none or is not the one users load: CLIP's
# two towers, VideoMAE's heads, Whisper's encoder-decoder, wav2vec2's CTC head with its pre-LN layout.
ISSUE_TYPES = ("normswap-demo", "olmo:OlmoForCausalLM", "bert", "clip:CLIPModel",
               "videomae:VideoMAEForVideoClassification", "videomae:VideoMAEForPreTraining",
               "whisper:WhisperForConditionalGeneration", "wav2vec2:Wav2Vec2ForCTC+do_stable_layer_norm=true")
EXACT_TYPES = (
    "aria", "audio-spectrogram-transformer", "audioflamingo3", "axk2", "aya_vision", "beit", "biogpt", "bloom",
    "clip_text_model", "clipseg", "codegen", "cohere_asr", "cosmos3_edge", "data2vec-vision", "deepseek_v32",
    "deit", "dinov2", "dinov2_with_registers", "dinov3_vit", "dpt", "falcon", "fuyu", "gemma3", "glm4v_moe",
    "glm_moe_dsa", "glmasr", "gpt2", "gpt_bigcode", "gpt_neox", "gptj", "hy_v4", "hy_v4_vl", "hy_v4_vl_text",
    "idefics3", "ijepa", "internvl", "kimi_k25", "m2m_100", "mbart", "mistral_large4", "mistral_large4_text",
    "moonshine", "mpt", "musicflamingo", "musicgen", "opt", "owlvit", "paddleocr_vl", "paligemma", "pegasus",
    "persimmon", "phi", "phimoe", "pixio", "qianfan_ocr", "qwen2_audio", "qwen2_vl", "qwen3_omni_moe_thinker",
    "siglip", "siglip2", "siglip2_vision_model", "siglip_vision_model", "speech_to_text", "stablelm", "swin",
    "swinv2", "timesformer", "tipsv2", "tipsv2_text_model", "tipsv2_vision_model", "ultravbert", "vilt", "vit",
    "vit_mae", "vit_msn", "vivit", "voxtral", "whisper", "xglm", "xlm-roberta-xl", "yolos")
TYPES = ISSUE_TYPES + EXACT_TYPES
USERS = ("user:demo", "user:olmo")


def first_line(e: BaseException) -> str:
    """The exception's type and first line (with the next where the first only announces it: "Error(s) in ...:")."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()] or [""]
    text = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]
    return f"{type(e).__name__}: {text[:300]}"


# ---- run in every process: the forward whose outputs are compared (also where normswap cannot be imported)

def plain(x):
    """A forward's output as dicts (ModelOutputs, caches by layer), tuples, lists and tensors: what normswap's
    parity walk names the same way (`past_key_values.0.keys`), and what pickles across transformers versions."""
    import torch
    if isinstance(x, torch.Tensor):
        return x.detach()
    if isinstance(x, dict) or hasattr(x, "to_tuple") and hasattr(x, "keys"):
        return {k: plain(x[k]) for k in x.keys()}
    if isinstance(x, (tuple, list)):
        return type(x)(plain(v) for v in x) if type(x) in (tuple, list) else tuple(plain(v) for v in x)
    if isinstance(getattr(x, "layers", None), list):   # a transformers Cache
        return {i: {k: plain(getattr(layer, k, None)) for k in ("keys", "values")} for i, layer in enumerate(x.layers)}
    parts = {k: plain(getattr(x, k)) for k in ("self_attention_cache", "cross_attention_cache")
             if getattr(x, k, None) is not None}
    return parts or None


def forward_all(model, inputs: list) -> list:
    """model(**batch) on each batch, seeded with its index as normswap's `compare_to` runs it."""
    import torch
    outs = []
    with torch.no_grad():
        for i, batch in enumerate(inputs):
            torch.manual_seed(i)
            outs.append(plain(model(**batch)))
    return outs


def auto_class(config: dict) -> str:
    """The class a user of plain transformers loads a folder with: the Auto class its auto_map offers for its
    architecture (else any it offers), else the Auto class whose table maps the architecture (its name without a
    "Normswap" prefix; under the folder's model type first), else the class of that name, else AutoModel."""
    import transformers
    arch = (config.get("architectures") or [""])[0]
    offered = sorted(k for k, v in (config.get("auto_map") or {}).items() if k != "AutoConfig" and isinstance(v, str))
    fits = [k for k in offered if config["auto_map"][k].endswith("." + arch)]
    if fits or offered:
        return (fits or offered)[0]
    base = arch[len("Normswap"):] if arch.startswith("Normswap") else arch
    tables = []
    for name in ["AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForImageClassification"] + sorted(
            n for n in dir(transformers) if n.startswith("AutoModel")):
        table = getattr(getattr(getattr(transformers, name, None), "_model_mapping", None), "_model_mapping", None)
        tables += [(name, table)] if isinstance(table, dict) else []

    def maps(names) -> bool:
        return names == base or isinstance(names, (list, tuple)) and base in names
    for name, table in tables:
        if maps(table.get(config.get("model_type"))):
            return name
    for name, table in tables:
        if any(maps(names) for names in table.values()):
            return name
    return base if hasattr(transformers, base) else "AutoModel"


def child_job(job: dict, out: dict) -> None:
    """One job of a plain child: load a folder (and run the inputs), re-save one, copy a file, or unpickle; what
    it found goes into `out` (an exception out of it is the job's error)."""
    import torch
    import transformers
    if job["kind"] == "copy":
        shutil.copyfile(job["src"], job["dest"])
        return
    if job["kind"] in ("signal", "wait"):   # the re-saved folders are written: the other child may read them
        deadline = time.time() + 600
        while job["kind"] == "wait" and not Path(job["path"]).exists() and time.time() < deadline:
            time.sleep(0.2)
        Path(job["path"]).touch()
        return
    if job.get("original") and not hasattr(transformers, job["original"]):
        out["na"] = f"transformers {transformers.__version__} has no {job['original']}"
        return
    if job["kind"] == "unpickle":
        model = torch.load(job["src"], weights_only=False).eval()
    else:
        config = json.loads((Path(job["src"]) / "config.json").read_text())
        out["class"] = name = auto_class(config)
        model, info = getattr(transformers, name).from_pretrained(job["src"], trust_remote_code=True,
                                                                  output_loading_info=True)
        model.eval()
        out["class"] = f"{name} -> {type(model).__name__}"
        out.update({k: sorted(v)[:5] + ([f"+{len(v) - 5}"] if len(v) > 5 else [])
                    for k, v in info.items() if v and k != "error_msgs"})
        renames = getattr(type(model), "_checkpoint_conversion_mapping", None)   # transformers 4's own renamings
        if renames:
            out["renames"] = len(renames)
    if job["kind"] == "resave":
        model.save_pretrained(job["dest"])
        return
    try:
        torch.save(forward_all(model, torch.load(job["inputs"], weights_only=False)), job["outputs"])
    except Exception as e:
        out["error"] = "forward: " + first_line(e)


def child(jobs_file: str) -> None:
    """Run the jobs in order; write {job id: result} beside the jobs file."""
    import transformers
    jobs = json.loads(Path(jobs_file).read_text())
    results = {"transformers": transformers.__version__}
    for job in jobs:
        results[job["id"]] = out = {}
        try:
            child_job(job, out)
        except Exception as e:
            out["error"] = first_line(e)
    Path(jobs_file).with_suffix(".out.json").write_text(json.dumps(results))


BLOCK = '''
import importlib.abc, sys
class Blocker(importlib.abc.MetaPathFinder):   # normswap cannot be imported here (as tests/models/test_shipped.py)
    def find_spec(self, name, path=None, target=None):
        if name == "normswap" or name.startswith("normswap."):
            raise ImportError("normswap is blocked here")
sys.meta_path.insert(0, Blocker())
sys.modules["normswap"] = None
'''


# ---- the measuring process (one per type)

def build_spec(spec: str):
    """(model in eval mode, its class name, perturbed?) for `type`, `type:Class`, `normswap-demo`."""
    import torch
    import transformers as tf

    import normswap
    if spec in ("normswap-demo", "user:demo"):
        model, _ = normswap.load_model("normswap-demo")
        return model.eval(), type(model).__name__, False
    if spec == "user:olmo":
        spec = "olmo:OlmoForCausalLM"
    spec, *settings = spec.split("+")   # TYPE:Class+key=value: a config setting (JSON value) on the tiny config
    model_type, _, name = spec.partition(":")
    if not name:
        model, name = build(model_type)
        return model, name, True
    cls = getattr(tf, name)
    config_cls = cls.config_class or tf.CONFIG_MAPPING[model_type]
    chosen = {k: json.loads(v) for k, v in (s.split("=", 1) for s in settings)}
    try:
        config = config_cls(**{**tiny_dict(config_cls()), **chosen})
        torch.manual_seed(0)
        return cls(config).eval(), name, True
    except Exception:   # as architectures.build: a layer count the kinds do not fit
        config = config_cls(**{**tiny_dict(config_cls(), every_kind=False), **chosen})
        torch.manual_seed(0)
        return cls(config).eval(), name, True


class Replay:
    """Stands in for a model in normswap's `compare_to`: returns the outputs a load gave, batch after batch."""

    def __init__(self, outputs: list):
        self.outputs, self.i = outputs, 0

    def __call__(self, **_):
        self.i += 1
        return self.outputs[self.i - 1]


def judge(outputs: list, conv, orig, declared: dict | None) -> dict:
    """A cell from a load's outputs: compared to the converted model's reference and (declared not None: an
    exact conversion) the original's, leaving out what the report declares not preserved."""
    from normswap.parity import compare_to, floating_outputs
    got = {n for o in outputs for n in floating_outputs(o)[0]}
    want = {n for o in conv.outputs for n in o}
    missing = {n: "not returned by this load" for n in sorted(want - got)}
    if not want & got:
        return {"outcome": "WRONG", "rel": float("inf"), "why": f"returns none of the outputs ({sorted(want)[:3]})"}
    cell: dict = {}
    if missing:
        cell["missing_outputs"] = sorted(missing)[:5]
    p = compare_to(conv, Replay(outputs), skip=missing)
    cell.update(rel=p.max_rel, worst=p.worst)
    judged = [p.max_rel]
    if declared is not None:
        q = compare_to(orig, Replay(outputs), skip={**declared, **missing})
        cell.update(rel_original=q.max_rel, worst_original=q.worst)
        judged.append(q.max_rel)
    cell["outcome"] = "OK" if all(v <= TOL for v in judged) else "WRONG"   # NaN: not <=
    return cell


def start_plain(work: Path, jobs: list[dict], python: str, block: bool, tag: str) -> tuple:
    """Start `jobs` in a fresh interpreter (`python`; with `block`, normswap unimportable, PYTHONPATH dropped)."""
    (work / f"{tag}.json").write_text(json.dumps(jobs))
    env = {**os.environ, "HF_MODULES_CACHE": str(work / f"modules-{tag}"), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    if block:
        env.pop("PYTHONPATH", None)
    code = (BLOCK if block else "") + (
        f"import sys; sys.path.insert(0, {str(HERE)!r}); import loaders; loaders.child({str(work / f'{tag}.json')!r})")
    with (work / f"{tag}.err").open("w") as err:
        proc = subprocess.Popen([python, "-c", code], cwd=work, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=err)
    return proc, work, jobs, tag, time.time()


def finish_plain(started: tuple) -> dict:
    """{job id: result} of a started child, its transformers version and seconds."""
    proc, work, jobs, tag, start = started
    try:
        proc.wait(timeout=900)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return {j["id"]: {"error": "timeout: the loading process ran over 900 s"} for j in jobs}
    out = work / f"{tag}.out.json"
    if not out.exists():
        tail = ((work / f"{tag}.err").read_text().strip().splitlines() or ["no output"])[-1]
        return {j["id"]: {"error": f"the loading process failed: {tail[:300]}"} for j in jobs}
    got = json.loads(out.read_text())
    version = got.pop("transformers")
    return {**got, f"transformers.{tag}": version, f"seconds.{tag}": round(time.time() - start, 1)}


def renamings(model) -> list[str]:
    """The checkpoint renamings transformers 5 applies to this model's weights on load (reversed on save)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        found = get_model_conversion_mapping(model, add_legacy=False)
    except Exception as e:
        return [f"(unknown: {first_line(e)})"]
    return [" -> ".join("|".join(getattr(t, k)) for k in ("source_patterns", "target_patterns"))
            if hasattr(t, "target_patterns") else type(t).__name__ for t in found]


def save(key: str, model, work: Path) -> Path:
    """Save the converted model by path `key`; the folder (or file) written."""
    import torch

    import normswap
    out = work / key
    if key in ("a", "a-user"):
        normswap.save_pretrained(model, out, tokenizer=None)
    elif key == "b":
        model.save_pretrained(out)
    elif key == "trainer":
        from transformers import Trainer, TrainingArguments
        args = TrainingArguments(output_dir=str(work / "trainer-run"), report_to="none", use_cpu=True)
        Trainer(model=model, args=args).save_model(str(out))
    elif key == "accelerate":
        from accelerate import Accelerator
        Accelerator(cpu=True).save_model(model, out)
    elif key == "pickle":
        out = work / "model.pt"
        torch.save(model, out)
    return out


def load_here(loader: str, folder: Path, cls, config):
    """(model, what transformers said) by loader 1, 4, 5a or 5b in this process; None where it does not apply."""
    import copy

    import safetensors.torch
    import torch

    import normswap
    if loader == "1":
        return normswap.from_pretrained(folder), {}
    if loader == "4":
        model, info = cls.from_pretrained(folder, output_loading_info=True)
        return model, {k: sorted(v)[:5] for k, v in info.items() if v and k != "error_msgs"}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {folder.name}")
    if loader == "5b" and len(files) > 1:
        return None
    torch.manual_seed(0)
    fresh = cls(copy.deepcopy(config))
    if loader == "5a":
        state = {}
        for f in files:
            state.update(safetensors.torch.load_file(f))
        fresh.load_state_dict(state)
    else:
        safetensors.torch.load_model(fresh, files[0])
    return fresh, {}


def plain_jobs(saves: list[str], folders: dict, work: Path, original: str) -> tuple[list[dict], list[dict]]:
    """(transformers 5 child's jobs: the re-saves, then a load of every folder; transformers 4's: the loads)."""
    jobs = []
    if "c" in saves and "b" in folders:
        jobs.append({"id": "save.c", "kind": "resave", "src": str(folders["b"]), "dest": str(work / "c")})
        folders["c"] = work / "c"
    if "resaved-orig" in saves and "a-user" in folders:
        dest = work / "resaved-orig"
        jobs += [{"id": "save.resaved-orig", "kind": "resave", "src": str(folders.pop("a-user")), "dest": str(dest)},
                 {"id": "copy", "kind": "copy", "src": str(work / "o" / "model.safetensors"),
                  "dest": str(dest / "model.safetensors")}]
        folders["resaved-orig"] = dest

    def loads(loader):
        return [{"id": f"{k}.{loader}", "kind": "load", "src": str(f), "inputs": str(work / "inputs.pt"),
                 "outputs": str(work / f"{k}.{loader}.pt"), "original": original}
                for k, f in folders.items() if k != "pickle"]
    marker = str(work / "resaved")   # transformers 4 loads once transformers 5 has re-saved (both import meanwhile)
    return (jobs + [{"id": "signal", "kind": "signal", "path": marker}] + loads("2"),
            [{"id": "wait", "kind": "wait", "path": marker}] + loads("3"))


def measure_cells(model, cls, config, saves: list[str], work: Path, conv, orig, declared,
                  original: str | None) -> tuple[dict, dict]:
    """({cell: outcome} for every save path x loader, {notes: versions, seconds, the re-saves' loads}); `original`:
    why the original's save (folder o, made before converting) failed, or None."""
    import torch
    folders, failed, start = {}, {}, time.time()
    if "o" in saves:
        folders, failed = ({}, {"o": original}) if original else ({"o": work / "o"}, {})
    # normswap.save_pretrained last: it updates config.normswap in place (format 2, the checksum of what it wrote),
    # so transformers' own save (b) and the user paths see the model as normswap.convert left it
    ours = ["a", "a-user"]
    for key in sorted([k for k in saves if k not in ("o", "c", "resaved-orig")] + (
            ["a-user"] if "resaved-orig" in saves else []), key=lambda k: k in ours):
        try:
            folders[key] = save(key, model, work)
        except Exception as e:
            failed["resaved-orig" if key == "a-user" else key] = "save: " + first_line(e)
    torch.save(conv.inputs, work / "inputs.pt")
    saved = round(time.time() - start, 1)
    jobs5, jobs4 = plain_jobs(saves, folders, work, cls.__name__)
    tf4 = os.environ.get("NORMSWAP_TF4_PYTHON")
    started = [start_plain(work, jobs5, sys.executable, True, "tf5")]   # the two run side by side
    if tf4:
        started.append(start_plain(work, jobs4, tf4, True, "tf4"))
    got = finish_plain(started[0])
    (work / "resaved").touch()   # also where transformers 5's child died before saying so
    for more in started[1:]:
        got.update(finish_plain(more))
    for key in ("c", "resaved-orig"):
        err = got.get(f"save.{key}", {}).get("error") or (got.get("copy", {}).get("error") if key != "c" else None)
        if key in folders and err:
            failed[key] = "save: " + err
            del folders[key]
    if "pickle" in folders:
        got.update(finish_plain(start_plain(work, [{"id": "pickle.t", "kind": "unpickle", "src": str(folders["pickle"]),
                                                    "inputs": str(work / "inputs.pt"),
                                                    "outputs": str(work / "pickle.t.pt")}],
                                            sys.executable, False, "pickle")))
    notes = {k: v for k, v in got.items() if k.startswith(("transformers", "seconds.", "save."))}
    notes["seconds.saves"], start, cells = saved, time.time(), {}
    for key in saves:
        for loader in FOLDER_LOADERS + (("t",) if "pickle" in saves else ()):
            cid = f"{key}.{loader}"
            if (loader == "t") != (key == "pickle"):
                cells[cid] = {"outcome": "n/a", "why": "a folder loader" if loader != "t" else "not a pickle"}
            elif key in failed:
                cells[cid] = {"outcome": "REFUSED", "why": failed[key]}
            elif loader == "3" and not tf4:
                cells[cid] = {"outcome": "n/a", "why": "no transformers 4 interpreter (--tf4-python)"}
            elif key == "o":   # the control: compared to the original only
                cells[cid] = cell(loader, key, folders, got, work, cls, config, orig, None, None)
            else:
                cells[cid] = cell(loader, key, folders, got, work, cls, config, conv, orig, declared)
    notes["seconds.here"] = round(time.time() - start, 1)
    return cells, notes


def cell(loader: str, key: str, folders: dict, got: dict, work: Path, cls, config, conv, orig, declared) -> dict:
    """The cell of save path `key` by `loader`: from the plain child's result (`got`), or loaded here."""
    import torch
    cid = f"{key}.{loader}"
    if loader in ("2", "3", "t"):
        res = got.get(cid, {"error": "not run"})
        info = {k: v for k, v in res.items() if k not in ("error", "na")}
        if "na" in res:
            return {"outcome": "n/a", "why": res["na"]}
        if "error" in res:
            return {"outcome": "REFUSED", "why": res["error"], **info}
        return {**judge(torch.load(work / f"{cid}.pt", weights_only=False), conv, orig, declared), **info}
    return cell_here(loader, folders[key], cls, config, conv, orig, declared)


def cell_here(loader: str, folder: Path, cls, config, conv, orig, declared) -> dict:
    try:
        loaded = load_here(loader, folder, cls, config)
    except Exception as e:
        return {"outcome": "REFUSED", "why": first_line(e)}
    if loaded is None:
        return {"outcome": "n/a", "why": "sharded: load_model reads one file"}
    model, info = loaded
    try:
        outputs = forward_all(model.eval(), conv.inputs)
    except Exception as e:
        return {"outcome": "REFUSED", "why": "forward: " + first_line(e), **info}
    return {**judge(outputs, conv, orig, declared), **info}


def measure(spec: str) -> dict:
    """Everything measured for one type or user row (see the module docstring)."""
    import copy

    import normswap
    from normswap.errors import NormswapError
    from normswap.models.inputs import sample_inputs
    from normswap.parity import compare_to, reference_outputs
    sys.path.insert(0, str(HERE.parent / "tests"))
    from helpers.exact_models import perturb

    start, row = time.time(), {"type": spec}
    try:
        model, row["class"], perturbed = build_spec(spec)
    except Exception as e:
        return {**row, "outcome": "unbuilt", "why": first_line(e)}
    if sum(p.numel() for p in model.parameters()) > 30e6:
        return {**row, "outcome": "unbuilt", "why": "big"}
    if perturbed:
        perturb(model)
    row["renamed"] = renamings(model)
    try:
        orig = reference_outputs(model, sample_inputs(model) + sample_inputs(model, batch=3, seq=11, seed=1))
    except Exception as e:
        return {**row, "outcome": "no-inputs", "why": first_line(e)}
    cls, config = type(model), copy.deepcopy(model.config)
    work = Path(tempfile.mkdtemp(prefix="loaders-"))
    try:
        user = spec.startswith("user:")
        try:   # the control (the original saved by transformers 5); its weights are copied over a user row's folder
            model.save_pretrained(work / "o")
            original = None
        except Exception as e:
            original = "save: " + first_line(e)
        try:
            report = normswap.convert(model, method="auto")
        except Exception as e:
            return {**row, "outcome": "refused" if isinstance(e, NormswapError) else "error", "why": first_line(e)}
        declared = dict(report.unverified) if report.method == "exact" else None
        row.update(method=report.method, converted=report.num_converted, declared=sorted(report.unverified))
        conv = reference_outputs(model, orig.inputs)
        row["convert_rel"] = compare_to(orig, model, skip=dict(report.unverified)).max_rel
        row["seconds.convert"] = round(time.time() - start, 1)
        cells, row["notes"] = measure_cells(model, cls, config, list(USER_SAVES) if user else ["o", *SAVES], work,
                                            conv, orig, declared, original)
        row["cells"] = json.loads(json.dumps(cells).replace(str(work), "OUT"))   # messages alike across types
        # the converted model in memory after every save (Trainer turns its config's use_cache off)
        row["memory_after_saves"] = judge(forward_all(model, conv.inputs), conv, None, None)
        row["outcome"] = "measured"
    finally:
        if not os.environ.get("NORMSWAP_LOADERS_KEEP"):
            shutil.rmtree(work, ignore_errors=True)
        else:
            row["work"] = str(work)
    row["seconds"] = round(time.time() - start, 1)
    return row


# ---- the tables

def columns(kind: str) -> list[str]:
    """The cells a table shows: "types" (save paths a, b, c by loader), "control" (o), "users" (by loader)."""
    if kind == "users":
        return [*FOLDER_LOADERS, "t"]
    return [f"{s}.{ld}" for s in (["o"] if kind == "control" else SAVES) for ld in FOLDER_LOADERS]


def short(cell: dict) -> str:
    if cell["outcome"] == "WRONG":
        worst = max((v for v in (cell.get("rel"), cell.get("rel_original")) if v is not None),
                    key=lambda v: float("inf") if v != v else v)
        return f"**WRONG** {worst:.1e}"
    return cell["outcome"]


def memory(r: dict) -> str:
    """The converted model in memory against the original (what every cell is also compared to)."""
    v = r.get("convert_rel", float("nan"))
    if r.get("method") != "exact":
        return f"{r.get('method')} {v:.1e}"
    return f"OK {v:.0e}" if v <= TOL else f"**off** {v:.1e}"


def table(rows: list[dict], kind: str) -> list[str]:
    cols = columns(kind)
    first = {"types": ["type", "class", "method", "renamed"], "control": ["type", "memory", "after saves"],
             "users": ["save path", "class", "method", "memory"]}[kind]
    lines = ["| " + " | ".join(first + cols) + " |", "|" + "---|" * (len(first) + len(cols))]
    for r in rows:
        for save in (USER_SAVES if kind == "users" else [None]):
            name = f"{r['type']} {save}" if save else r["type"]
            if r.get("outcome") != "measured":
                lines.append(f"| {name} | {r.get('outcome')}: {r.get('why', '')[:80]} |" + " |" * (len(first) - 2
                                                                                               + len(cols)))
                continue
            cells = [short(r["cells"].get(f"{save}.{c}" if save else c, {"outcome": "-"})) for c in cols]
            lead = {"types": [r["class"], r["method"], str(len(r.get("renamed", [])) or "")],
                    "control": [memory(r), r.get("memory_after_saves", {}).get("outcome", "-")],
                    "users": [r["class"], r["method"], memory(r)]}[kind]
            lines.append("| " + " | ".join([name, *lead, *cells]) + " |")
    return lines


def counts(rows: list[dict], kind: str) -> list[str]:
    cols = columns(kind)
    tally = {c: collections.Counter() for c in cols}
    for r in rows:
        for cid, cell in r.get("cells", {}).items():
            col = cid.split(".", 1)[1] if kind == "users" else cid
            if col in tally:
                tally[col][cell["outcome"]] += 1
    lines = ["| column | " + " | ".join(OUTCOMES) + " |", "|" + "---|" * (len(OUTCOMES) + 1)]
    lines += [f"| {c} | " + " | ".join(str(tally[c][o]) for o in OUTCOMES) + " |" for c in cols]
    return lines


def details(rows: list[dict]) -> list[str]:
    lines, refused = [], collections.defaultdict(list)
    for r in rows:
        for cid, cell in r.get("cells", {}).items():
            if cell["outcome"] == "WRONG":
                extra = {k: v for k, v in cell.items() if k not in ("outcome", "rel", "rel_original", "worst",
                                                                    "worst_original")}
                against = "original" if cid.startswith("o.") else "converted"
                orig = (f", vs original {cell['rel_original']:.2e} ({cell.get('worst_original')})"
                        if "rel_original" in cell else "")
                same = (" (the converted model reproduced: the conversion itself is off here)"
                        if cell.get("rel", 1) <= TOL and "rel_original" in cell else "")
                lines.append(f"- WRONG {r['type']} {cid}: vs {against} {cell.get('rel', float('nan')):.2e} "
                             f"({cell.get('worst')}){orig}{same}; {json.dumps(extra)[:300]}")
            elif cell["outcome"] == "REFUSED":
                col = cid.split(".", 1)[1] if r["type"].startswith("user:") else cid
                refused[(col, cell["why"][:200])].append(r["type"] + ("" if col == cid else f" {cid.split('.')[0]}"))
    lines.append("")
    for (col, why), who in sorted(refused.items()):
        lines.append(f"- REFUSED {col} x{len(who)}: {why} [{', '.join(who[:6])}{', ...' if len(who) > 6 else ''}]")
    return lines


def report(path: Path) -> None:
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    types = [r for r in rows if not r["type"].startswith("user:")]
    users = [r for r in rows if r["type"].startswith("user:")]
    versions = {f"{k.split('.')[1]} {v}" for r in rows for k, v in r.get("notes", {}).items()
                if k.startswith("transformers.")}
    print(f"{len(types)} model types, {len(users)} user rows, {path}; transformers {sorted(versions)}")
    print("\n".join(["", *table(types, "types"), "", *counts(types, "types")]))
    print("\n".join(["", "Control: the original, unconverted, saved by transformers 5 (o) and loaded by each loader,",
                     "compared to the original; memory: the converted model against the original.", "",
                     *table(types, "control"), "", *counts(types, "control")]))
    if users:
        print("\n".join(["", *table(users, "users"), "", *counts(users, "users")]))
    print("\n".join(["", *details(rows)]))


def tf4_python(given: str | None) -> str | None:
    """The interpreter with transformers 4.57: given, else .venv-tf4 beside the repository or this venv."""
    if given or os.environ.get("NORMSWAP_TF4_PYTHON"):
        return given or os.environ["NORMSWAP_TF4_PYTHON"]
    for p in (HERE.parent / ".venv-tf4/bin/python", Path(sys.prefix).parent / ".venv-tf4/bin/python"):
        if p.exists():
            return str(p)
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", help="comma-separated TYPE, TYPE:Class, normswap-demo, user:demo, user:olmo "
                                    "(default: TYPES and the user rows)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=Path("loaders.jsonl"))
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--timeout", type=int, default=900, help="seconds per type")
    ap.add_argument("--tf4-python", help="interpreter with transformers 4.57 (default: .venv-tf4 beside the repo "
                                         "or this venv); without one, column 3 is n/a")
    ap.add_argument("--memory-gb", type=int, default=12, help="address space per process (default 12 GB)")
    ap.add_argument("--report", type=Path, help="print the tables of an earlier run's JSONL")
    a = ap.parse_args()
    tf4 = tf4_python(a.tf4_python)
    if tf4:
        os.environ["NORMSWAP_TF4_PYTHON"] = tf4
    if a.one:
        import resource
        import warnings
        # A load that builds a class's default config (a folder without config.json: OLMo-7B) fails here as on a
        # smaller machine, instead of taking the shared machine's memory; the loading processes inherit it.
        limit = int(os.environ.get("NORMSWAP_LOADERS_MEMORY_GB", a.memory_gb)) << 30
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        warnings.filterwarnings("ignore")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        print(json.dumps(measure(a.one), default=str))
        return
    if a.report:
        report(a.report)
        return
    os.environ["NORMSWAP_LOADERS_MEMORY_GB"] = str(a.memory_gb)   # for the --one processes
    start = time.time()
    with a.out.open("w") as f:
        for row in isolated(__file__, a.types.split(",") if a.types else [*TYPES, *USERS], a.jobs, a.timeout):
            f.write(json.dumps(row, default=str) + "\n")
            f.flush()
            bad = collections.Counter(c["outcome"] for c in row.get("cells", {}).values())
            print(f"{row['type']:<44} {row.get('outcome', ''):<9} WRONG {bad['WRONG']:<2} REFUSED {bad['REFUSED']:<2} "
                  f"{row.get('seconds', '')} s {row.get('why', '')[:100]}", flush=True)
    print(f"{time.time() - start:.0f} s, {a.jobs} job(s), transformers 4 python: {tf4}")
    report(a.out)


if __name__ == "__main__":
    main()
