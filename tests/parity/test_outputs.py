"""The walk over a forward's outputs, one for parity, the trace and the lazy loader (names, caches, the
residual-stream tuples left out); parity over every floating output: each judged on its own scale, the worst
named, hidden-state tuples left out by name, outputs longer than the text mask (image tokens) and tuple outputs
compared."""
from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers as tf
from click.testing import CliRunner
from torch import nn
from transformers.cache_utils import DynamicCache

from normswap.cli import main
from normswap.models.inputs import sample_inputs
from normswap.parity import compare
from normswap.parity.outputs import floating_outputs, tensors, tensors_in


def test_one_walk_names_every_tensor_the_same_way():
    a, b, ids = torch.ones(2, 3), torch.zeros(2), torch.arange(3)
    cache = DynamicCache()
    cache.update(torch.ones(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), 0)
    out = {"logits": a, "nested": (b, {"x": ids}), "hidden_states": (a, b), "past_key_values": cache}
    assert [(n, t is x) for (n, t), x in zip(tensors(out), (a, b, ids, a, b))] == \
        [("logits", True), ("nested.0", True), ("nested.1.x", True), ("hidden_states.0", True),
         ("hidden_states.1", True)]   # the trace's view: no caches, the stream tuple included
    left: dict = {}
    names = [n for n, _ in tensors(out, caches=True, left=left)]
    assert names == ["logits", "nested.0", "nested.1.x", "past_key_values.0.keys", "past_key_values.0.values"]
    assert list(left) == ["hidden_states"]
    kept, excluded = floating_outputs(out)   # parity's view: floating tensors of the same walk
    assert list(kept) == ["logits", "nested.0", "past_key_values.0.keys", "past_key_values.0.values"]
    assert excluded == left and list(floating_outputs(a)[0]) == ["output"]
    assert [t is x for t, x in zip(tensors_in(((a, 1), {"w": b, "s": "no"})), (a, b))] == [True, True]
    assert [n for n, _ in tensors((a, [b]), None)] == [None, None]   # no names: the trace's hot path


class Toy(nn.Module):
    """Returns logits, an encoder state, a pooled vector, nested tuples, a hidden-state tuple and ids."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.enc = nn.Embedding(10, 4), nn.Linear(4, 4)
        self.head, self.pool = nn.Linear(4, 10), nn.Linear(4, 3)

    def forward(self, input_ids, attention_mask=None):
        h = self.emb(input_ids)
        e = self.enc(h)
        return {"logits": self.head(h), "encoder_last_hidden_state": e, "pooler_output": self.pool(e[:, 0]),
                "nested": (2 * e, (e.sum(-1),)), "hidden_states": (h, e), "ids": input_ids}


def batches():
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, 3:] = 0
    return [{"input_ids": torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]]), "attention_mask": mask}]


def by_hand(a: torch.Tensor, b: torch.Tensor, keep: torch.Tensor | None = None) -> tuple[float, float]:
    a, b = a.double(), b.double()
    if keep is not None:
        a, b = a[keep], b[keep]
    d = (a - b).abs().max().item()
    return d, d / a.abs().max().item()


@torch.no_grad()
def test_every_output_compared_the_worst_named_hidden_states_left_out():
    toy = Toy()
    changed = copy.deepcopy(toy)
    changed.enc.bias += 0.3 * torch.randn(4, generator=torch.Generator().manual_seed(1))   # logits untouched
    p = compare(toy, changed, batches())
    x = batches()[0]
    ref, got = toy(**x), changed(**x)
    keep = x["attention_mask"].bool()
    enc = "encoder_last_hidden_state"
    expect = {"logits": by_hand(ref["logits"], got["logits"], keep),
              enc: by_hand(ref[enc], got[enc], keep),
              "pooler_output": by_hand(ref["pooler_output"], got["pooler_output"]),
              "nested.0": by_hand(ref["nested"][0], got["nested"][0], keep),
              "nested.1.0": by_hand(ref["nested"][1][0], got["nested"][1][0])}   # (batch, length): all positions
    assert p.compared == list(expect) and expect["logits"] == (0.0, 0.0)
    assert {n: (o["max_abs"], o["max_rel"]) for n, o in p.outputs.items()} == expect
    worst = max(expect, key=lambda n: expect[n][1])
    assert p.worst == worst and (p.max_abs, p.max_rel) == expect[worst] and p.max_rel > 0.01
    assert p.output == "logits" and p.excluded == {"hidden_states": p.excluded["hidden_states"]}
    line = str(p)
    assert line.startswith(f"parity vs original ({worst}, worst of 5 outputs: logits, encoder_last_hidden_state, "
                           f"pooler_output, nested[2]; not compared: hidden_states (")
    d = json.loads(json.dumps(p.to_dict()))
    assert d["compared"] == list(expect) and d["worst"] == worst and "hidden_states" in d["excluded"]
    assert d["output"] == "logits" and d["max_rel"] == p.max_rel   # the old fields, still there


@torch.no_grad()
def test_a_missing_or_reshaped_output_is_an_infinite_error():
    toy = Toy()

    class Fewer(Toy):
        def forward(self, input_ids, attention_mask=None):
            out = super().forward(input_ids, attention_mask)
            out.pop("pooler_output")
            return out
    fewer = Fewer()
    fewer.load_state_dict(toy.state_dict())
    p = compare(toy, fewer, batches())
    assert p.worst == "pooler_output" and p.max_rel == float("inf") and p.outputs["logits"]["max_rel"] == 0.0


@torch.no_grad()
def test_an_empty_output_is_equal_and_the_rest_still_compared():
    """A width-0 output (GLM-5-Next's router slot in a tiny config) has nothing to differ in; it used to raise."""
    class Empty(Toy):
        def forward(self, input_ids, attention_mask=None):
            out = super().forward(input_ids, attention_mask)
            return {**out, "router": out["encoder_last_hidden_state"][..., :0]}
    toy, changed = Empty(), Empty()
    changed.load_state_dict(toy.state_dict())
    changed.head.bias += 1.0
    p = compare(toy, changed, batches())
    assert p.outputs["router"] == {"max_abs": 0.0, "max_rel": 0.0} and p.worst == "logits" and p.max_rel > 0.01


def tiny_git():
    torch.manual_seed(0)
    return tf.GitForCausalLM(tf.GitConfig(vocab_size=60, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                          intermediate_size=64, max_position_embeddings=64, vision_config=dict(
                                              hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                              intermediate_size=64, image_size=16, patch_size=8))).eval()


def tiny_vilt():
    torch.manual_seed(0)
    return tf.ViltModel(tf.ViltConfig(vocab_size=60, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=64, image_size=16, patch_size=8, max_image_length=-1,
                                      modality_type_vocab_size=2, max_position_embeddings=64)).eval()


def tiny_mgp():
    torch.manual_seed(0)
    return tf.MgpstrForSceneTextRecognition(tf.MgpstrConfig(
        image_size=[16, 32], patch_size=4, max_token_length=8, num_character_labels=10, num_bpe_labels=12,
        num_wordpiece_labels=14, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, mlp_ratio=2.0)).eval()


@pytest.mark.parametrize("build,names", [
    (tiny_git, {"logits"}),                            # image tokens prepended: longer than the text mask
    (tiny_vilt, {"last_hidden_state", "pooler_output"}),   # image tokens appended
    (tiny_mgp, {"logits.0", "logits.1", "logits.2"}),   # logits as a tuple of three heads
])
@torch.no_grad()
def test_outputs_longer_than_the_mask_and_tuples(build, names):
    """GIT and ViLT were IndexError (output longer than the attention mask), MGP-STR AttributeError (tuple
    logits): now each output is compared, everywhere where its length is not the mask's."""
    model = build()
    changed = copy.deepcopy(model)
    with torch.no_grad():
        w = next(p for n, p in changed.named_parameters() if p.dim() == 2 and "embed" not in n)
        w += 0.05
    inputs = sample_inputs(model)
    p = compare(model, changed, inputs)
    assert names <= set(p.compared)
    for name in names:
        d = r = 0.0
        for i, x in enumerate(inputs):   # ViLT samples patches at random: both runs draw the same
            a = floating_outputs(torch.manual_seed(i) and model(**x))[0][name]
            b = floating_outputs(torch.manual_seed(i) and changed(**x))[0][name]
            d, r = max(d, (a.double() - b.double()).abs().max().item()), max(r, a.double().abs().max().item())
        assert p.outputs[name]["max_abs"] == d and p.outputs[name]["max_rel"] == d / r
    assert p.max_rel == max(o["max_rel"] for o in p.outputs.values()) > 0


def test_cli_parity_line_and_json_name_the_outputs(tmp_path):
    torch.manual_seed(0)
    model = tf.Dinov2Model(tf.Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                           intermediate_size=64, image_size=16, patch_size=8)).eval()
    model.save_pretrained(tmp_path / "src")
    run = CliRunner().invoke(main, ["convert", str(tmp_path / "src"), "--to", "rmsnorm", "-o", str(tmp_path / "o"),
                                    "--json"])
    assert run.exit_code == 0, run.output
    parity = json.loads(run.output.splitlines()[-1])["parity"]
    assert parity["compared"] == ["last_hidden_state", "pooler_output"] and parity["worst"] in parity["compared"]
    assert parity["max_rel"] == parity["outputs"][parity["worst"]]["max_rel"] < 1e-5
    text = CliRunner().invoke(main, ["convert", str(tmp_path / "src"), "--to", "rmsnorm", "-o", str(tmp_path / "t")])
    assert "worst of 2 outputs: last_hidden_state, pooler_output): max |Δ|" in text.output
    ev = CliRunner().invoke(main, ["eval", str(tmp_path / "o"), "--reference", str(tmp_path / "src"), "--json"])
    assert ev.exit_code == 0, ev.output
    got = json.loads(ev.output)
    assert got["compared"] == parity["compared"] and got["max_rel"] == pytest.approx(parity["max_rel"], rel=1e-6)
