"""Issue 20 (10-13): what clients nobody here wrote do with normswap's folders. transformers 4.x / optimum
read tokenizer_config.json (no transformers-5-only class); OpenVINO compiles the graphs (no trailing empty
optional inputs) and agrees with ORT; onnxruntime-genai's batch path (encode_batch, right padding)
reproduces every prompt alone."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers.tiny import perturb, tiny_model
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402

import normswap  # noqa: E402
from normswap.models.demo import DEMO_DIR  # noqa: E402

pytestmark = pytest.mark.slow   # ONNX exports read back by optimum and onnxruntime-genai


PROMPTS = ["Emma was", "She said that the letter of her sister was not", "Anne"]


@pytest.fixture(scope="module")
@torch.no_grad()
def folders(tmp_path_factory):
    """A tiny converted GPT-2 with the demo's byte-level BPE tokenizer (what real models ship; genai's tokenizer
    mangles a whitespace-split toy BPE), saved and exported."""
    root = tmp_path_factory.mktemp("clients")
    tok = AutoTokenizer.from_pretrained(DEMO_DIR)
    torch.manual_seed(0)
    model = perturb(GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                               bos_token_id=0, eos_token_id=0))).eval()
    normswap.convert(model, method="naive")
    model.transformer.wte.weight.copy_(0.1 * torch.randn(model.transformer.wte.weight.shape))  # varied output
    normswap.save_pretrained(model, root / "conv", tokenizer=tok)
    normswap.export_folder(model, root / "onnx", tokenizer=tok)
    return model, tok, root


@pytest.mark.parametrize("which", ["conv", "onnx"])
def test_tokenizer_config_loads_in_transformers_4_too(folders, which):
    _, tok, root = folders
    config = json.loads((root / which / "tokenizer_config.json").read_text())
    # transformers 4.x has no TokenizersBackend; PreTrainedTokenizerFast is the same class in 4 and 5
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["model_input_names"] == ["input_ids", "attention_mask"]   # 4.x would add token_type_ids
    assert "local_files_only" not in config and "is_local" not in config
    loaded = PreTrainedTokenizerFast.from_pretrained(root / which)   # what 4.x's AutoTokenizer builds from it
    assert loaded(PROMPTS) == tok(PROMPTS) and "token_type_ids" not in loaded("Emma")
    if which == "onnx":   # no auto_map there: AutoTokenizer needs no config class, in 4.x or 5
        assert AutoTokenizer.from_pretrained(root / which)(PROMPTS) == tok(PROMPTS)


def _ov_vs_ort(path: str, feed: dict) -> float:
    """max |OpenVINO - ORT| / max |ORT| over the outputs, OpenVINO in f32 (its CPU default may be bf16)."""
    ov = pytest.importorskip("openvino")
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feed)
    core = ov.Core()
    compiled = core.compile_model(core.read_model(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    got = compiled(feed)
    return max(float(np.abs(got[compiled.output(i)] - r).max() / max(1.0, np.abs(r).max()))
               for i, r in enumerate(ref))


def test_layernorm_graphs_have_no_trailing_empty_inputs_and_run_in_openvino(tmp_path):
    """A model that keeps its LayerNorms exports SkipLayerNormalization nodes (bias input absent)."""
    normswap.export_onnx(tiny_model("gpt2"), tmp_path / "ln.onnx")
    graph = onnx.load(tmp_path / "ln.onnx").graph
    assert any(n.op_type == "SkipLayerNormalization" for n in graph.node)
    assert [n.name for n in graph.node if n.input and n.input[-1] == ""] == []
    ids = np.random.default_rng(0).integers(0, 97, (2, 7)).astype(np.int64)
    feed = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.tile(np.arange(7), (2, 1))}
    assert _ov_vs_ort(str(tmp_path / "ln.onnx"), feed) < 1e-5


def test_openvino_runs_the_deployment_folder_like_ort(folders):
    _, _, root = folders
    ids = np.random.default_rng(1).integers(0, 8000, (2, 7)).astype(np.int64)
    feed = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.tile(np.arange(7), (2, 1))}
    feed.update({f"past_key_values.{i}.{kv}": np.zeros((2, 4, 0, 8), np.float32) for i in range(2)
                 for kv in ("key", "value")})
    assert _ov_vs_ort(str(root / "onnx" / "model.onnx"), feed) < 1e-5


@torch.no_grad()
def test_genai_batch_path_reproduces_each_prompt(folders):
    """genai's own batch path: Tokenizer.encode_batch right-pads with pad_token_id; each row's new tokens
    equal that prompt run alone, in genai and in PyTorch."""
    og = pytest.importorskip("onnxruntime_genai")
    model, tok, root = folders
    genai = og.Model(str(root / "onnx"))
    batch = og.Tokenizer(genai).encode_batch(PROMPTS).as_numpy()
    lengths = [len(tok(p)["input_ids"]) for p in PROMPTS]
    assert batch.shape == (3, max(lengths)) and len(set(lengths)) == 3
    for row, n, prompt in zip(batch, lengths, PROMPTS):   # right-padded with pad_token_id (0)
        assert row[:n].tolist() == tok(prompt)["input_ids"] and not row[n:].any()
    new = 10
    params = og.GeneratorParams(genai)
    params.set_search_options(do_sample=False, max_length=batch.shape[1] + new, batch_size=3)
    gen = og.Generator(genai, params)
    gen.append_tokens(batch)
    while not gen.is_done():
        gen.generate_next_token()
    for i, prompt in enumerate(PROMPTS):
        ids = torch.tensor([tok(prompt)["input_ids"]])
        alone = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                               min_new_tokens=new, pad_token_id=0)[0, -new:].tolist()
        assert np.array(gen.get_sequence(i))[-new:].tolist() == alone, prompt
