"""`normswap export SRC -o DIR`: a deployment folder with optimum's decoder I/O conventions, left-padded
greedy generation in ORT equal to PyTorch row by row, external data, atomic writes and CLI errors."""
from __future__ import annotations

import json
import shutil
import stat

import numpy as np
import pytest
import torch
from click.testing import CliRunner

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
from helpers.export_models import converted, talkative  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

import normswap  # noqa: E402
from normswap.cli import main  # noqa: E402
from normswap.models.demo import DEMO_DIR  # noqa: E402
from normswap.export import fuse, validate, wrap  # noqa: E402

LAYERS = 2
TOTAL = "past_sequence_length + sequence_length"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A converted tiny GPT-2 saved with the demo's tokenizer, exported by the CLI: (model, result, dir)."""
    root = tmp_path_factory.mktemp("folder")
    model = talkative("gpt2")
    normswap.save_pretrained(model, root / "src", tokenizer=AutoTokenizer.from_pretrained(DEMO_DIR))
    result = CliRunner().invoke(main, ["export", str(root / "src"), "-o", str(root / "onnx"), "--json"])
    assert result.exit_code == 0, result.output
    return model, json.loads(result.output), root / "onnx"


def naive_positions(sess, feed, new=None):
    """Positions counted from the first (padding) column: what a graph without position_ids amounts to."""
    total, step = feed["attention_mask"].shape[1], feed["input_ids"].shape[1]
    feed["position_ids"] = np.broadcast_to(np.arange(total - step, total), feed["input_ids"].shape).copy()
    return feed


def shapes(values) -> dict[str, list]:
    return {v.name: v.shape for v in values}


def test_folder_holds_model_config_tokenizer_generation_config(folder):
    model, report, out = folder
    names = {p.name for p in out.iterdir()}
    assert {"model.onnx", "config.json", "generation_config.json", "genai_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= names
    assert report["files"] == sorted(names) and report["path"] == str(out / "model.onnx")
    assert not any(n.startswith(".") for n in out.parent.iterdir() for n in [n.name])   # no temp folder left
    assert stat.S_IMODE(out.stat().st_mode) & 0o055 == 0o055                            # readable by others
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["n_layer"] == LAYERS and config["use_cache"] is True
    assert "auto_map" not in config
    tok = AutoTokenizer.from_pretrained(out)
    assert tok("Emma") == AutoTokenizer.from_pretrained(DEMO_DIR)("Emma")
    # the report's own checks: fused norms, parity, generation including the left-padded batch
    assert report["validated"] and report["with_past"] and report["max_abs"] <= 1e-4
    assert sum(report["fused"].get(k, 0) for k in fuse.RMS_OPS) == 5
    assert report["generation"]["padded_rows_match"] == [True, True, True]


def test_optimum_input_output_names_and_axes(folder):
    _, _, out = folder
    sess = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    past = [f"past_key_values.{i}.{kv}" for i in range(LAYERS) for kv in ("key", "value")]
    present = [f"present.{i}.{kv}" for i in range(LAYERS) for kv in ("key", "value")]
    ins, outs = shapes(sess.get_inputs()), shapes(sess.get_outputs())
    assert list(ins) == ["input_ids", "attention_mask", "position_ids", *past]
    assert list(outs) == ["logits", *present]
    assert ins["input_ids"] == ins["position_ids"] == ["batch_size", "sequence_length"]
    assert ins["attention_mask"] == ["batch_size", TOTAL]
    assert all(ins[n] == ["batch_size", 4, "past_sequence_length", 8] for n in past)
    assert all(outs[n] == ["batch_size", 4, TOTAL, 8] for n in present)
    assert outs["logits"] == ["batch_size", "sequence_length", 97]
    assert {i.type for i in sess.get_inputs()[:3]} == {"tensor(int64)"}


@torch.no_grad()
def test_left_padded_greedy_generation_equals_pytorch_row_by_row(folder):
    model, _, out = folder
    sess = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    ids, mask = validate.left_padded(model.config.vocab_size, lengths=(2, 9, 6), seed=3)
    n = 16
    got = validate.ort_greedy(sess, model, ids.numpy(), n, np.float32, mask.numpy())[:, -n:]
    for row in range(len(ids)):
        prompt = ids[row:row + 1, mask[row] == 1]
        alone = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=n,
                               min_new_tokens=n, pad_token_id=0)[0, -n:].numpy()
        batch = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                               pad_token_id=0)[row, -n:].numpy()
        assert np.array_equal(got[row], alone) and np.array_equal(got[row], batch), row
    assert len({t for r in got for t in r.tolist()}) >= 5          # not one repeated token

    # The check can fail: positions counted from the padding (no position_ids from the mask) diverge.
    wrong = validate.ort_greedy(sess, model, ids.numpy(), n, np.float32, mask.numpy(),
                                positions=naive_positions)[:, -n:]
    assert np.array_equal(wrong[1], got[1])            # the longest prompt has no padding
    assert not np.array_equal(wrong[0], got[0]) or not np.array_equal(wrong[2], got[2])


@torch.no_grad()
def test_onnxruntime_genai_generates_like_pytorch(folder):
    """genai's own generate loop on the folder, one prompt at a time (its batch path, right-padded by
    Tokenizer.encode_batch, is tested in test_clients.py)."""
    og = pytest.importorskip("onnxruntime_genai")
    model, _, out = folder
    genai_model = og.Model(str(out))
    assert list(og.Tokenizer(genai_model).encode("Emma was")) == AutoTokenizer.from_pretrained(DEMO_DIR)("Emma was")[
        "input_ids"]
    for prompt in ([11, 57], [76, 90, 42, 43, 86, 88], [5, 17, 3, 42, 9]):
        params = og.GeneratorParams(genai_model)
        params.set_search_options(do_sample=False, max_length=len(prompt) + 16, min_length=len(prompt) + 16)
        gen = og.Generator(genai_model, params)
        gen.append_tokens(np.array([prompt], dtype=np.int32))
        while not gen.is_done():
            gen.generate_next_token()
        ids = torch.tensor([prompt])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                             min_new_tokens=16, pad_token_id=0)[0]
        assert np.array(gen.get_sequence(0)).tolist() == ref.tolist(), prompt


def test_position_ids_follow_hf():
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert wrap.position_ids(mask.copy(), 5).tolist() == [[1, 1, 0, 1, 2], [0, 1, 2, 3, 4]]
    assert wrap.position_ids(torch.from_numpy(mask), 2).tolist() == [[1, 2], [3, 4]]


@torch.no_grad()
def test_external_data_over_threshold_loads_in_ort(tmp_path):
    model = converted("gpt_neox")
    report = normswap.export_folder(model, tmp_path / "big", external_data_bytes=1000, with_past=False)
    assert report.external_data and report.validated
    assert {"model.onnx", "model.onnx.data"} <= set(report.files)
    data = (tmp_path / "big/model.onnx.data").stat().st_size
    assert data >= 0.9 * sum(p.numel() * 4 for p in model.parameters())     # the weights live there
    proto = onnx.load(str(tmp_path / "big/model.onnx"), load_external_data=False)
    assert all(i.data_location == onnx.TensorProto.EXTERNAL for i in proto.graph.initializer if len(i.dims) == 2)
    shutil.move(tmp_path / "big", tmp_path / "moved")             # the data file is found relative to the graph
    sess = ort.InferenceSession(str(tmp_path / "moved/model.onnx"), providers=["CPUExecutionProvider"])
    ids = np.arange(1, 12)[None]
    mask = np.ones_like(ids)
    got = sess.run(["logits"], {"input_ids": ids, "attention_mask": mask, "position_ids": np.arange(11)[None]})[0]
    ref = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits.numpy()
    assert np.abs(got - ref).max() <= 1e-4


def test_single_file_external_data(tmp_path):
    report = normswap.export_onnx(converted("gpt2"), tmp_path / "m.onnx", external_data_bytes=0)
    assert report.external_data and sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx.data"]


def test_encoder_folder_has_no_generation_config(tmp_path):
    report = normswap.export_folder(converted("bert"), tmp_path / "enc")
    assert not report.with_past and report.output == "last_hidden_state"
    assert report.files == ["config.json", "model.onnx"]


@pytest.mark.parametrize("args,msg", [
    ([], "error: give exactly one of -o DIR (deployment folder) and --onnx FILE"),
    (["-o", "d", "--onnx", "m.onnx"], "error: give exactly one of -o DIR (deployment folder) and --onnx FILE"),
])
def test_cli_needs_one_destination(tmp_path, monkeypatch, args, msg):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["export", "normswap-demo", *args])
    assert result.exit_code == 1 and result.output.strip() == msg and list(tmp_path.iterdir()) == []


def test_cli_existing_folder_kept_and_failed_export_leaves_nothing(tmp_path, monkeypatch):
    normswap.save_pretrained(converted("gpt2"), tmp_path / "src")
    (tmp_path / "out").mkdir()
    (tmp_path / "out/keep.txt").write_text("mine")
    result = CliRunner().invoke(main, ["export", str(tmp_path / "src"), "-o", str(tmp_path / "out")])
    assert result.exit_code == 1 and result.output.strip() == f"error: {tmp_path / 'out'} exists: pass --overwrite " \
                                                              "to replace it"
    result = CliRunner().invoke(main, ["export", str(tmp_path / "src"), "-o", str(tmp_path / "out"), "--overwrite"])
    assert result.exit_code == 1 and "was not written by normswap" in result.output  # keep.txt is not ours
    monkeypatch.setattr("normswap.export.onnx.FP32_TOL", 0.0)   # validation now fails
    result = CliRunner().invoke(main, ["export", str(tmp_path / "src"), "-o", str(tmp_path / "out"),
                                       "--overwrite-any"])
    assert result.exit_code == 1 and result.output.startswith("error: ORT output differs from PyTorch")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]


def test_validation_catches_positions_counted_from_padding(tmp_path, monkeypatch):
    """The issue's bug (a left-padded row generating differently) makes the export fail, writing nothing."""
    monkeypatch.setattr(validate, "with_positions", naive_positions)
    with pytest.raises(normswap.NormswapError, match=r"left-padded batch differs in rows \[0, 2\]"):
        normswap.export_folder(talkative("gpt2"), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []
