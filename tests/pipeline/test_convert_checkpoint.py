"""`convert_checkpoint`, the flow behind `normswap convert`: it streams a local folder when it can and converts
in memory otherwise, to the same files and report; it writes nothing when there is nothing to convert, when the
model is broken or when an option is wrong; with `onnx` it exports the model it saves."""
from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from normswap.checkpoint.lazy import InMemoryOnly
from normswap.errors import NormswapError
from normswap.models.load import LoadOptions
from normswap.pipeline import ConvertOptions, convert_checkpoint, lazy_convert

from helpers.cli import one_error_line, run
from helpers.exact_models import perturb
from helpers.heal_models import save_pair, text, tokenizer
from helpers.tiny import tiny_model

EXACT = ConvertOptions(method="exact", device="cpu")   # a local safetensors folder on the CPU: streamed
IN_MEMORY = dataclasses.replace(EXACT, load=LoadOptions(allow_missing_weights=True))   # the same, not streamed


def files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    tiny_model("llama").save_pretrained(root / "llama")
    tiny_model("gpt2").save_pretrained(root / "broken")
    config = json.loads((root / "broken" / "config.json").read_text())
    (root / "broken" / "config.json").write_text(json.dumps({**config, "layer_norm_epsilon": -1.0}))
    return root


def test_nothing_to_convert_prints_json_and_exits_0(folders, tmp_path):
    r = run("convert", folders / "llama", "--to", "rmsnorm", "-o", tmp_path / "o", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["report"]["converted"] == [] and len(out["report"]["already_rms"]) == 5
    assert out["message"] == f"nothing to convert: {folders / 'llama'} has no LayerNorm normswap can convert " \
                             "(5 RMSNorm already)"
    assert not (tmp_path / "o").exists()


def test_broken_norms_are_an_error_saying_why(folders, tmp_path):
    line = one_error_line(run("convert", folders / "broken", "--to", "rmsnorm", "-o", tmp_path / "o"))
    assert "5 LayerNorm-like modules (transformer.h.0.ln_1" in line and "give NaN/inf" in line
    in_memory = ConvertOptions(load=LoadOptions(allow_missing_weights=True))   # not streamed
    with pytest.raises(NormswapError, match="the model is broken"):
        convert_checkpoint(str(folders / "broken"), tmp_path / "o", in_memory)
    assert not (tmp_path / "o").exists()


def test_inputs_only_a_trial_forward_settles_are_built_in_memory(tmp_path):
    """Fuyu splices image patches into its text: how many tokens an image fills needs a forward with the
    weights, so the folder converts in memory (saying so) instead of tracing a guessed path."""
    import transformers as tf

    from normswap.pipeline import ConvertOptions, convert_checkpoint
    torch.manual_seed(0)
    model = perturb(tf.FuyuForCausalLM(tf.FuyuConfig(
        image_size=16, patch_size=8, num_channels=3, image_token_id=98,
        text_config=dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=64)))).eval()
    model.save_pretrained(tmp_path / "src")
    with pytest.raises(InMemoryOnly, match="trial forward"):
        lazy_convert.convert_folder(tmp_path / "src", tmp_path / "streamed")
    result = convert_checkpoint(str(tmp_path / "src"), tmp_path / "out", ConvertOptions(method="exact"))
    assert not result.streamed and any("trial forward" in n for n in result.notices)
    assert result.report.method == "exact" and result.parity.max_rel <= 1e-5


def test_streamed_and_in_memory_runs_write_the_same_files_and_report(gpt2_dir, tmp_path):
    streamed = convert_checkpoint(str(gpt2_dir), tmp_path / "streamed", EXACT)
    in_memory = convert_checkpoint(str(gpt2_dir), tmp_path / "in-memory", IN_MEMORY)
    assert streamed.streamed and not in_memory.streamed and streamed.notices == in_memory.notices == []
    assert (streamed.output, in_memory.output) == (str(tmp_path / "streamed"), str(tmp_path / "in-memory"))
    assert files(tmp_path / "streamed") == files(tmp_path / "in-memory")
    assert streamed.report.to_dict() == in_memory.report.to_dict() and streamed.report.num_converted == 5
    assert streamed.parity.to_dict() == in_memory.parity.to_dict() and streamed.parity.max_rel <= 1e-5


def test_onnx_exports_in_memory_and_saves_what_a_plain_run_saves(gpt2_dir, tmp_path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    plain = convert_checkpoint(str(gpt2_dir), tmp_path / "plain", EXACT)
    with_onnx = dataclasses.replace(EXACT, onnx=str(tmp_path / "m.onnx"))
    result = convert_checkpoint(str(gpt2_dir), tmp_path / "out", with_onnx)
    assert not result.streamed and result.output == str(tmp_path / "out")
    assert result.exported.validated and result.exported.path == str(tmp_path / "m.onnx")
    assert result.exported.max_abs <= result.exported.tolerance
    assert result.to_dict()["onnx"] == result.exported.to_dict()
    assert files(tmp_path / "out") == files(tmp_path / "plain")   # exporting changes nothing that is saved
    assert result.report.to_dict() == plain.report.to_dict()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "out", "plain"]


@pytest.mark.parametrize("options, streamed", [(EXACT, True), (IN_MEMORY, False)], ids=["streamed", "in-memory"])
def test_nothing_to_convert_writes_nothing(folders, tmp_path, options, streamed):
    result = convert_checkpoint(str(folders / "llama"), tmp_path / "o", options)
    assert result.streamed == streamed and result.report.converted == [] and len(result.report.already_rms) == 5
    assert result.to_dict() == {"report": result.report.to_dict(), "parity": None, "output": None}
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("changes, message", [
    (dict(finetune_steps=2, method="naive"), "finetune_steps needs data: plain text files to distil on"),
    (dict(data=("train.txt",)), "data is used only with finetune_steps"),
    (dict(max_shard_size="0B"), "bad shard size"),
])
def test_wrong_options_are_refused_before_anything(gpt2_dir, tmp_path, changes, message):
    with pytest.raises(NormswapError, match=re.escape(message)):
        convert_checkpoint(str(gpt2_dir), tmp_path / "o", dataclasses.replace(EXACT, **changes))
    assert list(tmp_path.iterdir()) == []


def test_healing_a_conversion_that_kept_the_outputs_is_refused_or_skipped(tmp_path):
    """Issue 46 #5: `convert --method exact --finetune-steps N` healed an exact model and saved a worse one
    (3.5e-7 -> 2.3e-3). Asked for up front, it is refused; where `auto` ends exact, the heal is skipped, saying
    so; a pRMSNorm (approximate even under exact) is still healed."""
    d = save_pair(tmp_path, tokenizer(), text(600))
    src, heal = str(d / "orig"), dict(finetune_steps=2, data=(str(d / "train.txt"),), device="cpu")
    with pytest.raises(NormswapError, match=re.escape("method='exact' keeps the original's outputs")):
        convert_checkpoint(src, tmp_path / "o", ConvertOptions(method="exact", **heal))
    line = one_error_line(run("convert", src, "--to", "rmsnorm", "--method", "exact", "--finetune-steps", 2,
                              "--data", d / "train.txt", "-o", tmp_path / "o"))
    assert "--finetune-steps heals a model the conversion changed, and --method exact keeps" in line
    assert not (tmp_path / "o").exists()
    result = convert_checkpoint(src, tmp_path / "auto", ConvertOptions(**heal))
    assert result.report.method == "exact" and result.healed is None and result.parity.max_rel < 1e-5
    assert any("`finetune_steps` was not used" in n for n in result.notices) and (tmp_path / "auto").is_dir()
    partial = convert_checkpoint(src, tmp_path / "p", ConvertOptions(method="exact", to="prmsnorm", **heal))
    assert partial.healed is not None and partial.healed.steps_done == 2
