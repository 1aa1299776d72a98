"""Module and tensor names across transformers' major versions (issue 33.1): a folder names its tensors as
transformers' own save_pretrained does (the names transformers 4 builds), and its section maps each module
transformers 5 renamed to that name, so the shipped file rebuilds the model under either version."""
from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch
import transformers as tf

import normswap
from normswap.folder import portable, fixes
from normswap.models.names import renamed_modules, saved_names

from helpers.exact_models import build

IDS = torch.tensor([[3, 14, 15, 92, 65, 35]])


class GPTNeoX4(tf.GPTNeoXForCausalLM):
    """GPT-NeoX as transformers 4.x builds it: the head is `embed_out` (checked against 4.57.6's class)."""

    def __init__(self, config):
        super().__init__(config)
        self.embed_out = self._modules.pop("lm_head")

    def forward(self, input_ids):
        return self.embed_out(self.gpt_neox(input_ids)[0])


@pytest.fixture(scope="module")
def neox(tmp_path_factory):
    """(the original's logits, the converted GPT-NeoX, its folder)."""
    model = build("gpt_neox-parallel")
    with torch.no_grad():
        expected = model(IDS).logits
    normswap.convert(model, to="rmsnorm")
    folder = tmp_path_factory.mktemp("neox") / "m"
    normswap.save_pretrained(model, folder)
    return expected, model, folder


@pytest.mark.parametrize("name", ["gpt2", "opt", "gpt_neox-parallel"])
def test_tensors_on_disk_are_named_as_transformers_saves_them(tmp_path, name):
    """normswap's weights files hold the keys transformers' own save_pretrained writes for the converted model
    (GPT-NeoX: embed_out.*, what 4.x loads), and `renamed` names each module whose keys differ."""
    model = build(name)
    normswap.convert(model, to="rmsnorm")
    normswap.save_pretrained(model, tmp_path / "ours")
    tf.PreTrainedModel.save_pretrained(model, tmp_path / "theirs")
    ours = safetensors.torch.load_file(tmp_path / "ours" / "model.normswap.safetensors")
    theirs = safetensors.torch.load_file(tmp_path / "theirs" / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    section = json.loads((tmp_path / "ours" / "config.json").read_text())["normswap"]
    assert section.get("renamed", {}) == renamed_modules(saved_names(model))
    assert section.get("renamed", {}) == ({"lm_head": "embed_out"} if name.startswith("gpt_neox") else {})


def test_renamed_modules_reads_the_shared_tail():
    assert renamed_modules({"lm_head.weight": "embed_out.weight", "lm_head.bias": "embed_out.bias",
                            "model.language_model.layers.0.ln.weight": "language_model.model.layers.0.ln.weight"}) \
        == {"lm_head": "embed_out", "model.language_model": "language_model.model"}


def test_gpt_neox_folder_rebuilds_with_transformers_4_names(neox):
    """The shipped code on GPT-NeoX as 4.x names it: the section's lm_head is found as embed_out, and the
    weights load by their stored names (as 4.x loads them): the original's logits. Failed before with "names
    module 'lm_head', which the ... model does not have"."""
    expected, _, folder = neox
    raw = json.loads((folder / "config.json").read_text())
    v4 = GPTNeoX4(tf.GPTNeoXConfig.from_dict({k: v for k, v in raw.items() if k not in ("auto_map", "model_type")}))
    assert "lm_head" not in dict(v4.named_modules())
    fixes.rebuild(v4, raw["normswap"], "m")
    v4.load_state_dict(safetensors.torch.load_file(folder / "model.normswap.safetensors"), strict=True)
    with torch.no_grad():
        got = v4.eval()(IDS)
    assert ((got - expected).abs().max() / expected.abs().max()) <= 1e-5
    assert isinstance(v4.embed_out.bias, torch.nn.Parameter)


def test_the_disk_name_is_taken_only_where_the_model_has_it(neox):
    _, model, folder = neox
    section = json.loads((folder / "config.json").read_text())["normswap"]
    assert portable.local_names(section, model)["added_biases"] == ["lm_head"]   # transformers 5's own names
    v4 = GPTNeoX4(model.config)
    assert portable.local_names(section, v4)["added_biases"] == ["embed_out"]
    portable.validate(section, "m", v4)
    section["renamed"] = {"lm_head": "head_out"}
    with pytest.raises(portable.InvalidConversion, match="names module 'lm_head' \\(nor 'head_out'\\), which"):
        portable.validate(section, "m", v4)


def test_normswap_and_plain_transformers_read_the_disk_names(neox):
    """normswap's own load and the shipped class in transformers 5 read embed_out.* back into lm_head (plain
    transformers renames only for its own classes: the shipped class registers the same renaming)."""
    expected, _, folder = neox
    for model in (normswap.from_pretrained(folder),
                  tf.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()):
        with torch.no_grad():
            got = model(IDS).logits
        assert ((got - expected).abs().max() / expected.abs().max()) <= 1e-5


def test_a_renamed_parent_renames_the_modules_under_it():
    """ViT: transformers 5's layers.N is encoder.layer.N in 4.x and on disk; a norm under it is found there."""
    layer = torch.nn.Module()
    layer.layernorm_before = torch.nn.LayerNorm(4)
    v4 = torch.nn.Module()
    v4.encoder = torch.nn.Module()
    v4.encoder.layer = torch.nn.ModuleList([layer])
    section = {"norms": {"layers.0.layernorm_before": {}}, "added_biases": [], "output_fixes": {},
               "renamed": {"layers": "encoder.layer", "layers.0.attention.q_proj": "encoder.layer.0.attention.query"}}
    assert list(portable.local_names(section, v4)["norms"]) == ["encoder.layer.0.layernorm_before"]
