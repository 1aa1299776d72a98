"""Issue 33 (18): a SRC folder holding a PEFT adapter is one folder that transformers reads two ways (some
loads apply the adapter, others not): every command refuses it alike, with one line."""
from __future__ import annotations

import json

import pytest

from normswap.errors import NormswapError
from normswap.models.load import load_model

from helpers.cli import one_error_line, run
from helpers.tiny import tiny_model


@pytest.fixture
def with_adapter(tmp_path):
    src = tmp_path / "src"
    tiny_model("gpt2").save_pretrained(src)
    (src / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "target_modules": ["c_attn"]}))
    (src / "adapter_model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    return src


def test_a_peft_adapter_in_src_is_refused_everywhere(tmp_path, with_adapter):
    expected = f"error: {with_adapter} holds a PEFT adapter (adapter_config.json): merge it into its base model " \
               "(peft's merge_and_unload, then save_pretrained) and pass that folder"
    for args in (["convert", with_adapter, "--to", "rmsnorm", "-o", tmp_path / "out"],             # streamed
                 ["convert", with_adapter, "--to", "rmsnorm", "-o", tmp_path / "out", "--finetune-steps", "1"],
                 ["eval", with_adapter],
                 ["export", with_adapter, "-o", tmp_path / "onnx"],
                 ["inspect", with_adapter]):
        assert one_error_line(run(*args)) == expected, args
    with pytest.raises(NormswapError, match="holds a PEFT adapter"):
        load_model(str(with_adapter))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
