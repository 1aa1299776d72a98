"""Converted folders load in plain transformers (trust_remote_code=True) exactly as in normswap, and
refuse to load without it; normswap itself reads old and new folders without running their code."""
import copy
import json
import os
import subprocess
import sys

import pytest
import torch

import normswap
from normswap.folder.shipped import original_class
import normswap.models.load
import normswap.models.save
from normswap.models.demo import DEMO_DIR
from normswap.folder import checksum
from normswap.folder import portable as template
from normswap.folder.modeling import MODELING_FILE

from helpers.exact_models import build
from helpers.tiny import tiny_model

# Exact conversions with each kind of structural change: biases created in bias-less linears (falcon-new),
# an output fix with a bias (bloom's embedding norm, a headless model's final norm), OPT's project_out.
EXACT = ["falcon-new", "bloom", "gpt2-headless", "opt-project"]
IDS = [[5, 17, 30, 42, 7, 91, 12, 8]]  # < 97: valid for the tiny models too

# Runs where normswap cannot be imported: blocked in sys.modules, repo not on the path, cwd elsewhere.
CHILD = r'''
import json, sys
sys.modules["normswap"] = None
import torch
from transformers import AutoModel, AutoModelForCausalLM, pipeline
jobs, out = json.load(open(sys.argv[1])), {}
for folder, kind in jobs.items():
    auto = AutoModelForCausalLM if kind == "causal" else AutoModel
    refused = []
    for trust in (False, None):  # None: transformers asks on stdin, which is not a terminal here
        try:
            auto.from_pretrained(folder, trust_remote_code=trust)
            refused.append("loaded")
        except Exception as e:
            refused.append(str(e))
    model = auto.from_pretrained(folder, trust_remote_code=True).eval()
    ids = torch.tensor(json.load(open(sys.argv[2])))
    with torch.no_grad():
        res = {"refused": refused, "cls": type(model).__name__}
        if kind == "causal":
            res["out"] = model(ids).logits.double().tolist()
            res["gen"] = model.generate(ids, max_new_tokens=8, do_sample=False).tolist()
            if "pipe" in folder:
                pipe = pipeline("text-generation", model=folder, trust_remote_code=True)
                res["text"] = pipe("It is a truth", max_new_tokens=8, do_sample=False)[0]["generated_text"]
                model.save_pretrained(folder + "-resaved")  # a colleague fine-tunes and saves with transformers
        else:
            res["out"] = model(ids).last_hidden_state.double().tolist()
    out[folder] = res
json.dump(out, open("result.json", "w"))
'''


def run_without_normswap(tmp_path, jobs: dict) -> dict:
    (tmp_path / "child.py").write_text(CHILD)
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    (tmp_path / "ids.json").write_text(json.dumps(IDS))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "child.py", "jobs.json", "ids.json"], cwd=tmp_path, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp_path / "result.json").read_text())


@pytest.mark.slow
def test_loads_without_normswap_exactly(tmp_path, monkeypatch):
    # The template repeats the PyTorch path's arithmetic; the fused CPU kernel rounds differently (~5e-7).
    monkeypatch.setenv("NORMSWAP_BACKEND", "torch")
    demo, tok = normswap.load_model("normswap-demo")
    jobs = {}
    for method, to in (("exact", "rmsnorm"), ("naive", "rmsnorm"), ("naive", "prmsnorm")):
        model = copy.deepcopy(demo)
        normswap.convert(model, to=to, method=method, p=0.25 if to == "prmsnorm" else None)
        folder = f"{method}-{to}" + ("-pipe" if method == "exact" else "")
        normswap.save_pretrained(model, tmp_path / folder, tokenizer=tok)
        jobs[folder] = "causal"
    bert = tiny_model("bert")
    normswap.convert(bert, method="naive")
    normswap.save_pretrained(bert, tmp_path / "bert")
    jobs["bert"] = "encoder"
    for family in EXACT:
        model = build(family)
        normswap.convert(model, method="exact")
        normswap.save_pretrained(model, tmp_path / family)
        jobs[family] = "encoder" if family.endswith("headless") else "causal"

    got = run_without_normswap(tmp_path, jobs)
    ids = torch.tensor(IDS)
    for folder, kind in jobs.items():
        ref = normswap.from_pretrained(tmp_path / folder)
        res = got[folder]
        assert res["cls"].startswith("Normswap")
        for message in res["refused"]:  # an exception, not a model
            assert message != "loaded" and "trust_remote_code=True" in message
        with torch.no_grad():
            if kind == "causal":
                want = ref(ids).logits.double()
                gen = ref.generate(ids, max_new_tokens=8, do_sample=False)
                assert res["gen"] == gen.tolist()
            else:
                want = ref(ids).last_hidden_state.double()
        assert (torch.tensor(res["out"], dtype=torch.float64) - want).abs().max() <= 1e-6
    # The converted models differ from the original, so matching them above is not vacuous ...
    with torch.no_grad():
        original = demo(ids).logits.double()
    assert (torch.tensor(got["naive-rmsnorm"]["out"]) - original).abs().max() > 1e-2
    # ... and the pipeline writes what normswap's model generates.
    ref = normswap.from_pretrained(tmp_path / "exact-rmsnorm-pipe")
    prompt = tok("It is a truth", return_tensors="pt").input_ids
    text = tok.decode(ref.generate(prompt, max_new_tokens=8, do_sample=False)[0])
    assert got["exact-rmsnorm-pipe"]["text"] == text
    # A folder re-saved by transformers keeps the classes and the section, and the shipped class records the
    # checksum of the weights it wrote: normswap loads it with every check, as the same model.
    resaved = tmp_path / "exact-rmsnorm-pipe-resaved"
    assert json.loads((resaved / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"].endswith(
        "NormswapGPT2LMHeadModel")
    with torch.no_grad():
        assert torch.equal(normswap.from_pretrained(resaved)(ids).logits, ref(ids).logits)


def test_folder_layout(tmp_path):
    model = tiny_model("gpt2")
    normswap.convert(model, method="exact")
    normswap.save_pretrained(model, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["model_type"] == "normswap_gpt2"
    assert config["architectures"] == ["NormswapGPT2LMHeadModel"]
    assert config["normswap"]["base"] == {"model_type": "gpt2", "architecture": "GPT2LMHeadModel"}
    assert config["auto_map"]["AutoConfig"] == "modeling_normswap.NormswapGPT2Config"
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_normswap.NormswapGPT2LMHeadModel"
    assert "AutoModel" not in config["auto_map"]  # a head's tied weights would leave the base incomplete
    source = (tmp_path / "m" / MODELING_FILE).read_text()
    assert "import normswap" not in source and "from normswap" not in source
    # normswap reads the original type and class back; the section is unchanged by the rewrite.
    loaded = normswap.from_pretrained(tmp_path / "m")
    assert original_class(loaded).__name__ == "GPT2LMHeadModel" and loaded.config.model_type == "gpt2"
    assert loaded.config.normswap == config["normswap"]
    # Saving a loaded model again gives the same config.
    normswap.save_pretrained(loaded, tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text()) == config


def test_a_fix_on_the_model_itself_keeps_its_class_and_saves(tmp_path):
    """Wav2Vec2-BERT's feature projection norms the model's own input, so the exact plan centres that input: a fix
    on the root module, whose class becomes a fixed subclass. The save must still find transformers' class (it
    refused the model as "not a transformers class"), through transformers' own save_pretrained too, and the
    folder rebuild the fix."""
    import transformers as tf

    from normswap.folder import fixes
    from helpers.exact_models import perturb
    from helpers.reload_models import MAKERS
    model = perturb(MAKERS["wav2vec2-bert"]()).eval()
    inputs = {"input_features": torch.randn(2, 20, 32, generator=torch.Generator().manual_seed(0))}
    with torch.no_grad():
        want = model(**inputs).last_hidden_state
    normswap.convert(model, method="exact")
    assert isinstance(model, fixes.Fixed) and original_class(model) is tf.Wav2Vec2BertModel
    for name, save in (("normswap", normswap.save_pretrained), ("transformers", lambda m, out: m.save_pretrained(out))):
        save(model, tmp_path / name)
        loaded = normswap.from_pretrained(tmp_path / name).eval()
        assert isinstance(loaded, fixes.Fixed) and original_class(loaded) is tf.Wav2Vec2BertModel, name
        with torch.no_grad():
            torch.testing.assert_close(loaded(**inputs).last_hidden_state, want, rtol=0, atol=1e-5)


def test_unconverted_model_stays_plain(tmp_path):
    normswap.save_pretrained(tiny_model("gpt2"), tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == "gpt2"
    assert not (tmp_path / "m" / MODELING_FILE).exists()


def test_normswap_never_runs_the_modeling_file(tmp_path, monkeypatch):
    model = tiny_model("gpt2")
    normswap.convert(model, method="exact")
    tok = normswap.models.load.load_tokenizer(str(DEMO_DIR))
    normswap.save_pretrained(model, tmp_path / "m", tokenizer=tok)
    (tmp_path / "m" / MODELING_FILE).write_text("raise RuntimeError('executed')\n")
    prompts = []  # transformers asks "Do you wish to run the custom code?" on a terminal
    monkeypatch.setattr("builtins.input", lambda *a: prompts.append(a) or "n")
    ids = torch.tensor(IDS)
    with torch.no_grad():
        want = model(ids).logits
        assert torch.equal(normswap.from_pretrained(tmp_path / "m")(ids).logits, want)
        loaded, loaded_tok = normswap.load_model(str(tmp_path / "m"))
        assert torch.equal(loaded(ids).logits, want)
    # The tokenizer is found through the original config: no prompt for custom code.
    assert loaded_tok is not None and loaded_tok("It is") == tok("It is")
    assert prompts == []


def test_old_layout_still_loads(tmp_path):
    """A format 2 folder, as normswap wrote them before modeling files and fingerprints: model_type of the original,
    no auto_map, model.safetensors: normswap still rebuilds it (with a warning: nothing to check it against)."""
    model = tiny_model("opt")
    normswap.convert(model, method="exact")
    normswap.save_pretrained(model, tmp_path / "old")
    config = json.loads((tmp_path / "old" / "config.json").read_text())
    (tmp_path / "old" / "model.normswap.safetensors").rename(tmp_path / "old" / "model.safetensors")
    (tmp_path / "old" / MODELING_FILE).unlink()
    section = {k: v for k, v in config["normswap"].items() if k not in ("fingerprint", "checksum")}
    section = {**section, "format": 2}
    config = {**{k: v for k, v in config.items() if k != "auto_map"}, "model_type": "opt", "normswap": section}
    config["normswap"]["checksum"] = checksum.checksum(section, tmp_path / "old")
    (tmp_path / "old" / "config.json").write_text(json.dumps(config))
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad(), pytest.warns(UserWarning, match="no fingerprint to check this model against"):
        assert torch.equal(normswap.from_pretrained(tmp_path / "old")(ids).logits, model(ids).logits)
        assert torch.equal(normswap.load_model(str(tmp_path / "old"))[0](ids).logits, model(ids).logits)


@pytest.mark.parametrize("p", [None, 0.25])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_template_norm_matches_normswap(p, dtype, monkeypatch):
    """The shipped RMSNorm computes what normswap's PyTorch path does (no drift), against an fp64 reference."""
    monkeypatch.setenv("NORMSWAP_BACKEND", "torch")  # the fused CPU kernel rounds differently (~1 ulp)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 48, generator=g) * 4 + 1).to(dtype)
    w = torch.rand(48, generator=g) + 0.5
    ours = (normswap.PartialRMSNorm(48, p=p, eps=1e-5) if p else normswap.RMSNorm(48, eps=1e-5)).to(dtype)
    shipped = template.RMSNorm(48, eps=1e-5, p=p).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(w)
        shipped.weight.copy_(w)
    k = 12 if p else 48
    xd = x.double()
    ref = xd / torch.sqrt(xd[..., :k].pow(2).mean(-1, keepdim=True) + 1e-5) * w.to(dtype).double()
    assert torch.equal(shipped(x), ours(x))
    huge = x.float() * 1e30  # squares overflow fp32 without the row scaling both implementations do
    assert torch.equal(shipped.float()(huge), ours.float()(huge)) and shipped.float()(huge).isfinite().all()
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    assert ((shipped(x).double() - ref).abs() / ref.abs().clamp_min(1)).max() <= tol


def test_cli_output_is_self_describing(tmp_path):
    from click.testing import CliRunner

    from normswap.cli import main
    tiny_model("gpt2").save_pretrained(tmp_path / "src")
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "src"), "--to", "rmsnorm", "--method", "naive", "-o",
                                       str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / MODELING_FILE).exists()
    result = CliRunner().invoke(main, ["inspect", str(tmp_path / "out")])  # read back by the CLI
    assert result.exit_code == 0, result.output
    assert "transformer.ln_f" in result.output


def test_template_partial_width_matches_normswap():
    from normswap.ops import partial_width
    for d in (1, 7, 32, 100, 256, 4096):
        for p in (None, 0.01, 0.0625, 0.07, 0.1, 0.3, 1 / 3, 0.5, 0.999, 1.0):
            assert template.partial_width(d, p) == partial_width(d, p), (d, p)
    assert template.partial_width(100, 0.07) == 7


def test_auto_classes_of_a_model_built_for_another_types_config():
    """MusicGen's decoder (model type musicgen_decoder) is what AutoModelForCausalLM builds for MusicGen's
    config: a converted decoder folder names it, so plain transformers loads it (no type maps it directly)."""
    from normswap.folder.modeling import auto_classes
    assert auto_classes("musicgen_decoder", "MusicgenForCausalLM") == {"AutoModelForCausalLM": "MusicgenForCausalLM"}
    gpt2 = auto_classes("gpt2", "GPT2LMHeadModel")
    assert "AutoModelForCausalLM" in gpt2 and "AutoModel" not in gpt2   # a head: no base-model class offered
