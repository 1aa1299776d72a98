"""The behavioural fingerprint (`normswap/folder/fingerprint.py`): probe inputs regenerated bit for bit, digests that
move with any wrong value, a tolerance per dtype, and the loaders that refuse a model that does not reproduce it."""
from __future__ import annotations

import json
import shutil

import pytest
import safetensors.torch
import torch
from torch import nn

import normswap
from normswap.folder import fingerprint as fp
from normswap.folder.schema import FingerprintFailed

from helpers.restore_models import Encoder, TiedLM
from helpers.tiny import tiny_model


def reference_hash32(n: int, seed: int) -> list[int]:
    """The same 32-bit mix in plain Python integers (no torch, no overflow): what every machine computes."""
    out = []
    for i in range(n):
        x = (i + (seed * 0x9E3779B1 + 0x632BE5AB) % (1 << 32)) & 0xFFFFFFFF
        for _ in range(2):
            x = (((x >> 16) ^ x) * 0x45D9F3B) & 0xFFFFFFFF
        out.append((x >> 16) ^ x)
    return out


@pytest.mark.parametrize("seed", [0, 1, 12345])
def test_hash_is_plain_integer_arithmetic(seed):
    got = fp.hash32(1000, seed)
    assert got.dtype is torch.int64 and got.tolist() == reference_hash32(1000, seed)
    u = fp.uniform(100_000, seed)
    assert 0 <= float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.01


def test_probe_round_trip_keeps_integers_and_regenerates_floats():
    batch = {"input_ids": torch.randint(0, 50, (1, 7)), "mask": torch.ones(1, 7, dtype=torch.bool),
             "big": torch.randint(3, 9, (2, 3000)), "pixels": torch.randn(2, 3, 32, 32) * 3 + 1,
             "scale": torch.tensor([0.5, 2.0]), "flag": True, "pair": (torch.zeros(2, 2, dtype=torch.long), None)}
    spec = json.loads(json.dumps(fp.encode(batch)))   # through JSON, as config.json keeps it
    a = fp.decode(spec, torch.device("cpu"), torch.float32)
    b = fp.decode(spec, torch.device("cpu"), torch.float32)
    assert torch.equal(a["input_ids"], batch["input_ids"]) and torch.equal(a["mask"], batch["mask"])
    assert torch.equal(a["scale"], batch["scale"]) and a["flag"] is True and a["pair"][1] is None
    assert a["big"].shape == (2, 3000) and int(a["big"].min()) >= 3 and int(a["big"].max()) <= 8
    assert torch.equal(a["big"], b["big"]) and torch.equal(a["pixels"], b["pixels"])   # the same bits again
    assert a["pixels"].shape == (2, 3, 32, 32) and abs(float(a["pixels"].mean()) - float(batch["pixels"].mean())) < 0.1
    assert abs(float(a["pixels"].std()) - float(batch["pixels"].std())) < 0.1
    assert fp.decode(spec, torch.device("cpu"), torch.bfloat16)["pixels"].dtype is torch.bfloat16
    with pytest.raises(TypeError):
        fp.encode({"x": torch.tensor([float("nan"), 1.0] * 40)})
    with pytest.raises(TypeError):
        fp.encode({"x": object()})


def test_digest_catches_a_wrong_value_anywhere_and_tolerates_rounding():
    out = {"logits": torch.randn(2, 16, 500, dtype=torch.float64), "hidden": torch.randn(2, 16, 8)}
    record = {"dtype": "float32", "outputs": fp.digest(out)}
    assert fp.mismatch(record, out, torch.float32) is None
    noisy = {k: v * (1 + 1e-6 * torch.randn_like(v)) for k, v in out.items()}
    assert fp.mismatch(record, noisy, torch.float32) is None
    one = {**out, "logits": out["logits"].clone()}
    one["logits"][1, 9, 321] += 40 * out["logits"].std()   # one element, between the samples
    assert "`logits` is off by" in fp.mismatch(record, one, torch.float32)
    wrong = {**out, "logits": out["logits"] * 0.8}
    assert "`logits` is off by" in fp.mismatch(record, wrong, torch.float32)
    halves = {k: v.bfloat16() for k, v in out.items()}   # a bf16 load of an fp32 folder: its own tolerance
    assert fp.mismatch(record, halves, torch.float32) is not None
    assert fp.mismatch(record, halves, torch.bfloat16) is None
    assert "shape" in fp.mismatch(record, {**out, "logits": out["logits"][:1]}, torch.float32)
    assert "does not return `logits`" in fp.mismatch(record, {"hidden": out["hidden"]}, torch.float32)
    assert fp.mismatch(record, {**out, "extra": torch.ones(3)}, torch.float32) is None   # another version's field


class Noisy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) + torch.rand_like(x)   # draws random numbers even in eval


def test_a_model_that_draws_random_numbers_gets_no_fingerprint_and_says_why():
    probe = {"args": fp.encode((torch.ones(2, 4),)), "kwargs": fp.encode({})}
    with pytest.warns(UserWarning, match="depend on the random generator"):
        found = fp.record(Noisy(), probe)
    assert "outputs" not in found and "random" in found["none"]


def test_probe_runs_in_eval_without_grad_and_restores_the_mode():
    model = Encoder().train()
    probe = {"args": fp.encode(()), "kwargs": fp.encode({"x": torch.randn(1, 3, 12)})}
    torch.manual_seed(5)
    before = torch.rand(1)
    torch.manual_seed(5)
    found = fp.record(model, probe)
    assert model.training and "outputs" in found and torch.equal(torch.rand(1), before)   # the caller's RNG intact
    # each module's own flag, not one for the whole model: a frozen part left in eval stays there
    first = next(m for m in model.modules() if m is not model)
    first.eval()
    flags = {n: m.training for n, m in model.named_modules()}
    fp.record(model, probe)
    assert {n: m.training for n, m in model.named_modules()} == flags and not first.training


def converted_module(cls=TiedLM, **kw):
    torch.manual_seed(0)
    model = cls(**kw).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    example = torch.randint(0, 37, (2, 6)) if issubclass(cls, TiedLM) else torch.randn(2, 5, 12)
    normswap.convert(model, method="exact", example_inputs=example)
    return model, example


def test_a_module_folder_records_the_first_example_and_restore_checks_it(tmp_path):
    model, example = converted_module()
    normswap.save_pretrained(model, tmp_path / "m")
    record = json.loads((tmp_path / "m" / "normswap.json").read_text())
    found = record["fingerprint"]
    # token ids: the example's first fp.PROBE_TOKENS positions (a forward of a few tokens: a small share of a load)
    kept = fp.decode(found["probe"]["kwargs"], "cpu", torch.float32)["idx"]
    assert torch.equal(kept, example[:, :fp.PROBE_TOKENS]) and fp.PROBE_TOKENS < example.shape[1]
    assert set(found["outputs"]) == {"output"} and found["dtype"] == "float32"
    fresh = normswap.restore(TiedLM(), tmp_path / "m")
    assert torch.equal(fresh(example), model(example))


class FixedLength(TiedLM):
    """A model that runs on its full block only (a fixed-size position table added whole)."""

    def forward(self, idx):
        if idx.shape[1] != 6:
            raise ValueError(f"expected 6 positions, got {idx.shape[1]}")
        return super().forward(idx)


def test_a_model_that_needs_its_full_length_keeps_the_whole_example_as_its_probe(tmp_path):
    model, example = converted_module(FixedLength)
    normswap.save_pretrained(model, tmp_path / "m")
    found = json.loads((tmp_path / "m" / "normswap.json").read_text())["fingerprint"]
    assert torch.equal(fp.decode(found["probe"]["kwargs"], "cpu", torch.float32)["idx"], example)
    assert "outputs" in found   # still self-verifying
    fresh = normswap.restore(FixedLength(), tmp_path / "m")
    assert torch.equal(fresh(example), model(example))


class TiedOther(TiedLM):
    """The same parameter names as an untied TiedLM, but a head that shares the embedding."""


def test_restore_onto_a_model_that_ties_what_was_saved_untied_is_refused(tmp_path):
    torch.manual_seed(1)
    untied = TiedLM()
    untied.head.weight = nn.Parameter(untied.wte.weight.detach().clone() + 0.5 * torch.randn(37, 16))
    example = torch.randint(0, 37, (2, 6))
    normswap.convert(untied, method="exact", example_inputs=example)
    normswap.save_pretrained(untied, tmp_path / "m")
    with pytest.raises(normswap.NormswapError) as e:   # a structural refusal or the fingerprint's
        normswap.restore(TiedOther(), tmp_path / "m")
    assert "\n" not in str(e.value)


class Swapped(Encoder):
    """Encoder's parameter names and shapes, another computation."""

    def forward(self, x):
        return self.norm(self.blocks(self.proj(x).flip(-1)))


def test_restore_onto_another_class_with_the_same_names_is_refused_by_the_fingerprint(tmp_path):
    model, example = converted_module(Encoder)
    normswap.save_pretrained(model, tmp_path / "m")
    with pytest.raises(FingerprintFailed, match="does not reproduce the outputs recorded"):
        normswap.restore(Swapped(), tmp_path / "m")
    assert normswap.restore(Swapped(), tmp_path / "m", check_fingerprint=False) is not None


def test_weights_of_the_same_layout_swapped_in_are_refused(tmp_path, monkeypatch):
    """The checksum hashes headers: another file of the same names, dtypes and shapes passes it; the fingerprint
    does not (the hostile probe's OLMo case: the original's weights copied over a converted folder)."""
    model = tiny_model("gpt2")
    normswap.convert(model, method="naive")
    normswap.save_pretrained(model, tmp_path / "m")
    file = tmp_path / "m" / "model.normswap.safetensors"
    assert {t.dtype for t in safetensors.torch.load_file(file).values()} == {torch.float32}
    raw = bytearray(file.read_bytes())   # the header kept byte for byte, every value moved
    start = 8 + int.from_bytes(raw[:8], "little")
    values = torch.frombuffer(raw, dtype=torch.float32, offset=start)
    values.add_(0.05 * torch.randn_like(values))
    file.write_bytes(bytes(raw))
    with pytest.raises(FingerprintFailed, match="off by"):
        normswap.from_pretrained(tmp_path / "m")
    monkeypatch.setenv(fp.SKIP_ENV, "1")   # the documented switch
    assert normswap.from_pretrained(tmp_path / "m") is not None
    monkeypatch.delenv(fp.SKIP_ENV)
    assert normswap.from_pretrained(tmp_path / "m", check_fingerprint=False) is not None


def test_a_tampered_fingerprint_is_refused_by_the_checksum(tmp_path):
    model = tiny_model("gpt2")
    normswap.convert(model, method="naive")
    normswap.save_pretrained(model, tmp_path / "m")
    edited = tmp_path / "e"
    shutil.copytree(tmp_path / "m", edited)
    config = json.loads((edited / "config.json").read_text())
    config["normswap"]["fingerprint"]["outputs"]["logits"]["norm"] *= 2
    (edited / "config.json").write_text(json.dumps(config))
    with pytest.raises(normswap.NormswapError, match="edited after normswap saved it"):
        normswap.from_pretrained(edited)
