"""save_pretrained / restore for a module without a transformers config: weights + normswap.json, rebuilt on a
fresh instance of the user's class, bit-identical; every bad folder or model a one-line error."""
import json

import pytest
import torch

import normswap
from normswap.errors import NormswapError
from normswap.io import owned
from normswap.norms import PartialRMSNorm, RMSNorm

from helpers.restore_models import Encoder, PairOut, TiedLM, built
from helpers.user_models import GPT, gpt


def gpt_batches(n: int, t: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"idx": torch.randint(0, 61, (n, t), generator=g), "prefix": torch.randn(n, 8, generator=g)}


def tokens(vocab: int):
    return lambda n, t, seed: torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(seed))


def features(n: int, t: int, seed: int):
    return torch.randn(n, t, 12, generator=torch.Generator().manual_seed(seed))


# (build a fresh instance for a seed, inputs(batch, length, seed)); the example inputs are (2, 8), the checks
# run on other batch sizes and lengths
CASES = {"gpt": (lambda seed: gpt(seed), gpt_batches), "tied": (lambda seed: built(TiedLM, seed), tokens(37)),
         "final_norm_out": (lambda seed: built(Encoder, seed), features)}


def run(model, batch):
    with torch.no_grad():
        return model(**batch) if isinstance(batch, dict) else model(batch)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """case -> (converted model, its folder): each converted exactly on its example inputs and saved once."""
    out = {}
    for case, (make, inputs) in CASES.items():
        model = make(0)
        report = normswap.convert(model, method="exact", example_inputs=[inputs(2, 8, 0), inputs(1, 5, 1)])
        assert report.method == "exact"
        folder = tmp_path_factory.mktemp("saved") / case
        normswap.save_pretrained(model, folder)
        out[case] = (model, folder)
    return out


@pytest.mark.parametrize("case", CASES)
def test_restore_is_bit_identical(saved, case):
    model, folder = saved[case]
    make, inputs = CASES[case]
    fresh = make(1)   # other initial weights: every value must come from the folder
    assert normswap.restore(fresh, folder) is fresh
    for n, t, seed in ((3, 11, 5), (1, 4, 6), (4, 16, 7)):
        assert torch.equal(run(fresh, inputs(n, t, seed)), run(model, inputs(n, t, seed)))
    assert fresh.normswap_section == json.loads(json.dumps(model.normswap_section))
    state, restored = model.state_dict(), fresh.state_dict()
    assert state.keys() == restored.keys() and all(torch.equal(state[k], restored[k]) for k in state)
    assert sorted(p.name for p in folder.iterdir()) == ["model.normswap.safetensors", "normswap.json"]


def test_restore_rebuilds_the_recorded_structure(saved):
    tied = normswap.restore(built(TiedLM, 3), saved["tied"][1])
    assert tied.head.weight is tied.wte.weight                       # still tied: saved once
    assert tied.wte.normswap_centre and tied.head.bias is not None   # centred at lookup, bias added to the head
    enc = normswap.restore(built(Encoder, 3), saved["final_norm_out"][1])
    assert isinstance(enc.norm, RMSNorm) and enc.norm.eps == 1e-5
    assert torch.equal(enc.norm.normswap_bias, saved["final_norm_out"][0].norm.normswap_bias)
    record = json.loads((saved["final_norm_out"][1] / "normswap.json").read_text())
    assert record["format"] == 4 and record["base"]["architecture"].endswith("restore_models.Encoder")
    assert record["output_fixes"] == {"norm": {"centre": False, "bias": 16}}


def test_prmsnorm_and_sharded_weights(tmp_path):
    model = built(Encoder)
    normswap.convert(model, to="prmsnorm", p=0.5, method="naive")
    normswap.save_pretrained(model, tmp_path / "m", max_shard_size=2000)
    assert (tmp_path / "m" / "model.safetensors.index.normswap.json").is_file()
    fresh = normswap.restore(built(Encoder, 9), tmp_path / "m")
    assert isinstance(fresh.norm, PartialRMSNorm) and fresh.norm.p == 0.5
    x = features(3, 6, 2)
    assert torch.equal(run(fresh, x), run(model, x))


def test_unconverted_module_saves_an_empty_record(tmp_path):
    model = built(Encoder)
    normswap.save_pretrained(model, tmp_path / "m")
    assert not hasattr(model, "normswap_section")
    fresh = normswap.restore(built(Encoder, 4), tmp_path / "m")
    assert fresh.normswap_section["norms"] == {} and type(fresh.norm) is torch.nn.LayerNorm
    assert torch.equal(run(fresh, features(2, 3, 0)), run(model, features(2, 3, 0)))


def one_line_error(call) -> str:
    with pytest.raises(NormswapError) as e:
        call()
    assert "\n" not in str(e.value)
    return str(e.value)


def test_another_class_or_structure_is_refused(saved, tmp_path):
    folder = saved["final_norm_out"][1]
    msg = one_line_error(lambda: normswap.restore(built(PairOut), folder))
    assert "missing cls.bias, cls.weight" in msg and "saved from" in msg and "PairOut" in msg
    msg = one_line_error(lambda: normswap.restore(built(Encoder, d=8), folder))
    assert "'blocks.0.ln' is a 16-wide norm" in msg and "width 8" in msg
    msg = one_line_error(lambda: normswap.restore(built(TiedLM), folder))
    assert "does not have" in msg and "saved from" in msg
    msg = one_line_error(lambda: normswap.restore(GPT(layers=1), saved["gpt"][1]))
    assert "blocks.1" in msg


def test_edited_record_or_swapped_weights_are_refused(saved, tmp_path):
    import shutil
    folder = tmp_path / "m"
    shutil.copytree(saved["final_norm_out"][1], folder)
    record = json.loads((folder / "normswap.json").read_text())
    record["norms"]["norm"]["eps"] = 1e-3
    (folder / "normswap.json").write_text(json.dumps(record))
    assert "edited after normswap saved it" in one_line_error(lambda: normswap.restore(built(Encoder), folder))
    shutil.copy(saved["tied"][1] / "model.normswap.safetensors", folder / "model.normswap.safetensors")
    shutil.copy(saved["final_norm_out"][1] / "normswap.json", folder / "normswap.json")
    assert "weights are not the ones saved" in one_line_error(lambda: normswap.restore(built(Encoder), folder))
    (folder / "normswap.json").write_text("{not json")
    assert "normswap.json cannot be read" in one_line_error(lambda: normswap.restore(built(Encoder), folder))


def test_wrong_folders_and_models(saved, tmp_path):
    folder = saved["final_norm_out"][1]
    converted = saved["final_norm_out"][0]
    assert "already converted or restored" in one_line_error(lambda: normswap.restore(converted, folder))
    assert "not a folder" in one_line_error(lambda: normswap.restore(built(Encoder), tmp_path / "nothing"))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert "normswap.from_pretrained" in one_line_error(lambda: normswap.restore(built(Encoder), tmp_path / "hf"))
    assert "normswap.restore" in one_line_error(lambda: normswap.from_pretrained(folder))
    assert "torch.nn.Module" in one_line_error(lambda: normswap.restore("model", folder))
    assert "torch.nn.Module" in one_line_error(lambda: normswap.save_pretrained(object(), tmp_path / "x"))


def test_overwrite_rules_as_for_hf_folders(tmp_path):
    model, out = built(Encoder), tmp_path / "m"
    normswap.save_pretrained(model, out)
    assert owned.foreign(out) is None
    assert "exists" in one_line_error(lambda: normswap.save_pretrained(model, out))
    normswap.save_pretrained(model, out, overwrite=True)
    (out / "notes.txt").write_text("mine")
    assert "holds files normswap does not write" in one_line_error(
        lambda: normswap.save_pretrained(model, out, overwrite=True))
    assert (out / "notes.txt").read_text() == "mine"
    other = tmp_path / "other"
    other.mkdir()
    (other / "normswap.json").write_text('{"format": 2}')   # not a record normswap writes
    assert "was not written by normswap" in one_line_error(
        lambda: normswap.save_pretrained(model, other, overwrite=True))


@pytest.mark.parametrize("content", ["[]", "null", "3", '"normswap"'])
def test_a_record_that_is_not_a_json_object_is_refused(saved, tmp_path, content):
    """Issue 46 #5: `[]` or `null` gave AttributeError."""
    import shutil
    folder = tmp_path / "m"
    shutil.copytree(saved["final_norm_out"][1], folder)
    (folder / "normswap.json").write_text(content)
    msg = one_line_error(lambda: normswap.restore(built(Encoder), folder))
    assert msg == f"{folder / 'normswap.json'} is not a normswap record (a JSON object): it holds {content}"


class UntiedLM(TiedLM):
    """TiedLM with a head of its own (other values than the embedding's)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.head.weight = torch.nn.Parameter(torch.randn_like(self.wte.weight))


def test_a_model_that_ties_what_the_folder_stores_apart_is_refused(tmp_path):
    """Issue 46 #5: restoring an untied save onto a tied model loaded both tensors into its one shared parameter
    (rel 0.96-1.58). The other way round, the folder stores the tied tensor once: the untied head is missing."""
    for cls in (UntiedLM, TiedLM):
        model = built(cls)
        normswap.convert(model, method="naive")
        normswap.save_pretrained(model, tmp_path / cls.__name__)
    msg = one_line_error(lambda: normswap.restore(built(TiedLM, 1), tmp_path / "UntiedLM"))
    assert "this model ties wte.weight and head.weight (one tensor), which the folder stores as different" in msg
    assert "missing head.weight" in one_line_error(lambda: normswap.restore(built(UntiedLM, 1), tmp_path / "TiedLM"))
    for cls in (UntiedLM, TiedLM):   # each onto its own kind: the saved model
        fresh, x = normswap.restore(built(cls, 1), tmp_path / cls.__name__), tokens(37)(2, 6, 0)
        saved_model = built(cls)
        normswap.convert(saved_model, method="naive")
        assert torch.equal(run(fresh, x), run(saved_model, x))
