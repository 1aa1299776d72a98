"""heal(train="lora"): adapters through peft lower the held-out KL, train only what they say, and merge into
the weights, so the saved folder is the plain architecture (no peft name) in normswap and in transformers."""
from __future__ import annotations

import copy
import json
import sys

import pytest
import torch
from click.testing import CliRunner
from helpers.heal_models import bert, gpt2, save_pair, text, tokenizer
from safetensors import safe_open

import normswap
from normswap.io.safetensors import weights_names
from normswap.cli import main
from normswap.errors import NormswapError
from normswap.evaluation import evaluate
from normswap.healing.lora import Adapters, targets
from normswap.healing.options import LoraOptions
from normswap.models.rebuild import from_pretrained

pytest.importorskip("peft")

FAST = dict(seq_len=32, batch_size=4, progress=False)
TRAIN, HELD = [text(3000, seed=0)], [text(600, seed=9)]


def _kl(model, teacher, tok):
    return evaluate(model, tok, HELD, reference=teacher, seq_len=32).kl


def _keys(folder):
    with safe_open(folder / weights_names(folder)[0], "pt") as f:
        return set(f.keys())


def test_lora_heal_lowers_kl_and_saves_a_plain_folder(pair, tok, tmp_path):
    teacher, student = pair
    s = copy.deepcopy(student)
    before = _kl(s, teacher, tok)
    report = normswap.heal(s, teacher, TRAIN, tokenizer=tok, steps=40, train="lora", out=tmp_path / "h", **FAST)
    after = _kl(s, teacher, tok)
    assert before > 0.05 and after < 0.4 * before, (before, after)  # measured: 0.124 -> 0.03
    # merged: the student is its own architecture again, with the parameter names it had
    assert [n for n, _ in s.named_parameters()] == [n for n, _ in student.named_parameters()]
    assert not hasattr(s, "peft_config") and all("lora" not in type(m).__module__ for m in s.modules())
    assert report.lora["targets"] == ["c_attn", "c_fc", "c_proj"] and report.lora["rank"] == LoraOptions.rank
    lora = 2 * (LoraOptions.rank * (32 + 96) + LoraOptions.rank * (32 + 32) + LoraOptions.rank * (32 + 128)
                + LoraOptions.rank * (128 + 32))
    assert report.trainable == lora + 5 * 32  # adapters of 2 blocks + 5 norm gains
    # the folder: the same tensor names as a norms-only heal, loading to the merged model in normswap...
    assert _keys(tmp_path / "h") == {k for k in student.state_dict() if k != "lm_head.weight"}
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    assert "peft" not in json.dumps(config) and config["normswap_heal"]["train"] == "lora"
    loaded = from_pretrained(tmp_path / "h")
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), s.state_dict().values()))
    # ... and in plain transformers, through the folder's modeling_normswap.py
    from transformers import AutoModelForCausalLM
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "h", trust_remote_code=True).eval()
    x = torch.randint(0, len(tok), (2, 20))
    with torch.no_grad():
        assert torch.allclose(plain(input_ids=x).logits, s(input_ids=x).logits, rtol=0, atol=1e-5)


def test_merged_weights_give_the_adapted_function(pair):
    _, student = pair
    s = copy.deepcopy(student)
    adapters = Adapters(s, LoraOptions(rank=4, alpha=8))
    with torch.no_grad():
        for p in adapters.params:
            p.normal_(0, 0.3)   # B starts at zero: make the adapters do something
    x = torch.randint(0, 160, (2, 16))
    with torch.no_grad():
        adapted = s(input_ids=x).logits.double()
        adapters.merge()
        merged = s(input_ids=x).logits.double()
        plain = student(input_ids=x).logits.double()
    scale = adapted.abs().max()
    assert (merged - adapted).abs().max() / scale < 1e-5
    assert (plain - adapted).abs().max() / scale > 1e-2   # the adapters changed the function


@pytest.mark.parametrize("norms", [True, False])
def test_lora_changes_only_the_targets_and_norm_gains(pair, tok, norms):
    teacher, student = pair
    s = copy.deepcopy(student)
    before = {k: v.clone() for k, v in s.state_dict().items()}
    normswap.heal(s, teacher, TRAIN, tokenizer=tok, steps=5, train="lora",
                  lora=LoraOptions(rank=2, targets=("c_attn",), norms=norms), **FAST)
    changed = {k for k, v in s.state_dict().items() if not torch.equal(v, before[k])}
    gains = {f"transformer.h.{i}.{n}.weight" for i in range(2) for n in ("ln_1", "ln_2")} | {"transformer.ln_f.weight"}
    assert changed == {f"transformer.h.{i}.attn.c_attn.weight" for i in range(2)} | (gains if norms else set())
    assert all(p.requires_grad for p in s.parameters())  # flags restored


def test_default_targets_are_the_linear_layers_but_the_head():
    btok = tokenizer(bert=True)
    assert sorted({n.rsplit(".", 1)[-1] for n in targets(bert(len(btok)), None)}) == [
        "dense", "key", "query", "value"]
    g = gpt2(160)
    assert targets(g, None) == [f"transformer.h.{i}.{n}" for i in range(2)
                                for n in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    assert targets(g, ("mlp.c_proj",)) == ["transformer.h.0.mlp.c_proj", "transformer.h.1.mlp.c_proj"]


@pytest.mark.parametrize("wanted, match", [
    (("q_proj",), "no module of that name; the model's linear layers are c_attn, c_fc, c_proj, lm_head"),
    (("ln_1",), "a module but not a linear layer"),
    (("lm_head",), "is the output head, whose weight is the input embeddings'"),
])
def test_bad_targets(wanted, match):
    with pytest.raises(NormswapError, match=match):
        targets(gpt2(160), wanted)


@pytest.mark.parametrize("kwargs, match", [
    (dict(rank=0), "lora.rank must be an integer >= 1"), (dict(rank=2.5), "lora.rank"),
    (dict(alpha=0), "lora.alpha must be a finite number > 0"), (dict(alpha=float("nan")), "lora.alpha"),
    (dict(targets=" , "), "lora.targets names no module"), (dict(targets=[1]), "must be names"),
])
def test_bad_lora_options(kwargs, match):
    with pytest.raises(NormswapError, match=match):
        LoraOptions(**kwargs)


# --- CLI --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tok, tmp_path_factory):
    return save_pair(tmp_path_factory.mktemp("lora"), tok, TRAIN[0])


def _heal(saved, out, *extra):
    args = ["heal", saved / "conv", "--teacher", saved / "orig", "--data", saved / "train.txt", "--steps", 3,
            "--seq-len", 32, "--batch-size", 4, "--train", "lora", "-o", out, *extra]
    return CliRunner().invoke(main, [str(a) for a in args])


def test_cli_lora_matches_the_api(saved, tok, tmp_path):
    r = _heal(saved, tmp_path / "h", "--lora-rank", 4, "--lora-alpha", 4, "--lora-targets", "c_attn,mlp.c_fc",
              "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["lora"] == {"rank": 4, "alpha": 4.0, "targets": ["c_attn", "c_fc"], "norms": True}
    (s, _), (teacher, _) = normswap.load_model(str(saved / "conv")), normswap.load_model(str(saved / "orig"))
    normswap.heal(s, teacher, TRAIN, tokenizer=tok, steps=3, train="lora",
                  lora=LoraOptions(4, 4, ("c_attn", "mlp.c_fc")), **FAST)
    loaded = from_pretrained(tmp_path / "h").state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in s.state_dict().items())


@pytest.mark.parametrize("extra, code, needle", [
    (["--lora-rank", 0], 2, "Invalid value for '--lora-rank'"),
    (["--lora-alpha", -1], 2, "Invalid value for '--lora-alpha'"),
    (["--lora-targets", "q_proj"], 1, "unknown LoRA target 'q_proj' (--lora-targets)"),
    (["--lora-targets", ","], 1, "--lora-targets names no module"),
])
def test_cli_bad_lora_values_are_one_line_errors(saved, tmp_path, extra, code, needle):
    r = _heal(saved, tmp_path / "h", *extra)
    assert r.exit_code == code and needle in r.stderr, r.output
    assert r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "h").exists()


def test_without_peft_lora_is_a_one_line_error(saved, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # what `import peft` meets when it is not installed
    r = _heal(saved, tmp_path / "h")
    assert r.exit_code == 1 and r.stderr == "error: --train lora needs peft: pip install 'normswap[heal]' " \
                                            "(or pip install peft)\n", r.output
    assert not (tmp_path / "h").exists()


def test_a_failure_before_training_leaves_the_student_as_it_was(pair, tok):
    """Adapters injected, flags changed, weights in fp32 for training: an error (here a tracker failing to
    start) must undo all of it."""
    from accelerate.tracking import GeneralTracker

    class Broken(GeneralTracker):
        name, requires_logging_directory, tracker = "broken", False, None

        def store_init_configuration(self, values):
            raise RuntimeError("tracker server unreachable")

    teacher, student = pair
    s = copy.deepcopy(student).half()
    s.transformer.wte.weight.requires_grad_(False)
    before = {k: v.clone() for k, v in s.state_dict().items()}
    with pytest.raises(RuntimeError, match="unreachable"):
        normswap.heal(s, teacher, TRAIN, tokenizer=tok, steps=3, train="lora", report_to=[Broken()], **FAST)
    assert s.state_dict().keys() == before.keys() and all(torch.equal(v, before[k]) for k, v in s.state_dict().items())
    assert {p.dtype for p in s.parameters()} == {torch.float16}
    assert [n for n, p in s.named_parameters() if not p.requires_grad] == ["transformer.wte.weight"]


def test_an_interrupted_lora_heal_saves_merged_weights_to_the_partial(pair, tok, tmp_path):
    teacher, student = pair
    s = copy.deepcopy(student)

    def interrupt(step, loss):
        if step == 2:
            raise KeyboardInterrupt
    report = normswap.heal(s, teacher, TRAIN, tokenizer=tok, steps=10, train="lora", out=tmp_path / "h",
                           callback=interrupt, **FAST)
    assert report.interrupted and report.steps_done == 2 and not (tmp_path / "h").exists()
    assert _keys(tmp_path / "h.partial") == {k for k in student.state_dict() if k != "lm_head.weight"}
    loaded = from_pretrained(tmp_path / "h.partial")
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), s.state_dict().values()))
    assert [n for n, _ in s.named_parameters()] == [n for n, _ in student.named_parameters()]


def test_a_diverged_lora_heal_saves_nothing_and_leaves_a_plain_model(pair, tok, tmp_path):
    teacher, student = pair
    s = copy.deepcopy(student)
    with pytest.raises(NormswapError, match="training diverged"):
        normswap.heal(s, teacher, TRAIN, tokenizer=tok, steps=6, train="lora", lr=1e30, out=tmp_path / "h",
                      **FAST)
    assert not (tmp_path / "h").exists() and not (tmp_path / "h.partial").exists()
    assert [n for n, _ in s.named_parameters()] == [n for n, _ in student.named_parameters()]
    assert not hasattr(s, "peft_config")
