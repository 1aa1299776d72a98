"""Issue 20.5: a converted folder's generation_config.json (eos lists, pad, sampling settings,
max_new_tokens) survives loading, heal and export, and genai_config.json follows it."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers.export_models import talkative
from helpers.heal_models import text, tokenizer
from transformers import GenerationConfig

import normswap

SETTINGS = dict(bos_token_id=0, pad_token_id=3, do_sample=True, temperature=0.7, top_p=0.9, top_k=20,
                repetition_penalty=1.1, max_new_tokens=50)


def generation(folder) -> dict:
    d = json.loads((folder / "generation_config.json").read_text())
    d.pop("transformers_version", None)
    return d


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A converted GPT-2 saved with eos [0, T], T a later greedy token, and non-default sampling settings."""
    model = talkative("gpt2")
    ids = torch.tensor([[11, 57, 23]])
    with torch.no_grad():
        greedy = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6,
                                min_new_tokens=6, pad_token_id=0)[0, 3:].tolist()
    k = next(k for k in range(1, 6) if greedy[k] not in greedy[:k])   # the first new token after the first
    assert 0 not in greedy[:k + 1]
    model.generation_config = GenerationConfig(eos_token_id=[0, greedy[k]], **SETTINGS)
    folder = tmp_path_factory.mktemp("gen") / "conv"
    normswap.save_pretrained(model, folder, tokenizer=tokenizer(vocab=90))   # ids < the 97 of the model
    return folder, ids[0].tolist(), greedy[:k + 1]


def test_loading_a_converted_folder_keeps_its_generation_config(source):
    folder, _, _ = source
    model, _ = normswap.load_model(str(folder))
    assert model.generation_config.to_diff_dict() | {"transformers_version": None} == generation(folder) | {
        "transformers_version": None}
    assert model.generation_config.eos_token_id == generation(folder)["eos_token_id"]


def test_heal_keeps_the_generation_config(source, tmp_path):
    folder, _, _ = source
    student, tok = normswap.load_model(str(folder))
    teacher, _ = normswap.load_model(str(folder))
    normswap.heal(student, teacher, [text(800)], tokenizer=tok, steps=1, seq_len=16, batch_size=2,
                  progress=False, out=tmp_path / "healed")
    assert generation(tmp_path / "healed") == generation(folder)


def test_export_keeps_it_and_genai_follows_it(source, tmp_path):
    folder, prompt, greedy = source
    model, tok = normswap.load_model(str(folder))
    normswap.export_folder(model, tmp_path / "onnx", tokenizer=tok)
    out = tmp_path / "onnx"
    assert generation(out) == generation(folder)
    genai = json.loads((out / "genai_config.json").read_text())
    eos = generation(folder)["eos_token_id"]
    assert genai["model"]["eos_token_id"] == eos and genai["model"]["pad_token_id"] == 3
    assert {k: genai["search"][k] for k in ("do_sample", "temperature", "top_p", "top_k", "repetition_penalty")} \
        == {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}
    assert genai["search"]["max_length"] == model.config.n_positions   # not HF's default max_length of 20

    og = pytest.importorskip("onnxruntime_genai")
    params = og.GeneratorParams(og.Model(str(out)))
    params.set_search_options(do_sample=False, repetition_penalty=1.0, max_length=len(prompt) + 10)
    gen = og.Generator(og.Model(str(out)), params)
    gen.append_tokens(np.array([prompt], dtype=np.int32))
    while not gen.is_done():
        gen.generate_next_token()
    # stopped at the second eos id (genai leaves the eos token out of the sequence; with eos 0 alone it runs on)
    assert np.array(gen.get_sequence(0)).tolist() == prompt + greedy[:-1]
