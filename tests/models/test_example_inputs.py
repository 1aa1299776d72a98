"""`example_inputs`: batches bound to the forward's signature, placed on the model's device and dtype; the
inputs a model is traced and verified on (normswap's samples, then the user's; the user's alone elsewhere)."""
import pytest
import torch
from torch import nn

from normswap.errors import NormswapError
from normswap.models.inputs import sample_inputs
from normswap.models.inputs.examples import NoInputs, as_batches, model_inputs
from helpers.tiny import tiny_model


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, y=None, *, scale: float = 1.0, **extra):
        return self.lin(x) * scale + (0 if y is None else y)


class Star(nn.Module):
    def forward(self, *xs):
        return sum(xs)


def test_each_kind_of_batch_binds_by_name():
    m, x, y = Two(), torch.randn(2, 4), torch.randn(2, 4)
    got = as_batches(m, [x, (x, y), {"x": x, "scale": 2.0}, {"x": x, "other": y}])
    assert [sorted(b) for b in got] == [["x"], ["x", "y"], ["scale", "x"], ["other", "x"]]
    assert torch.equal(got[1]["y"], y) and got[2]["scale"] == 2.0
    assert as_batches(m, (x,))[0].keys() == {"x"} and as_batches(m, None) == []


def test_floating_inputs_take_the_models_dtype_integers_stay():
    m = Two().double()
    b = as_batches(m, {"x": torch.randn(1, 4), "y": torch.ones(1, 4, dtype=torch.int64)})[0]
    assert b["x"].dtype == torch.float64 and b["y"].dtype == torch.int64


@pytest.mark.parametrize("bad, match", [
    ([], "empty list"),
    ("nope/missing.pt", "does not exist"),
    (3, "batch 0 is a int"),
    ({"x": 1.0}, "holds no tensor"),
    ({0: torch.ones(1)}, "keys must be strings"),
    ((torch.ones(1, 4), torch.ones(1, 4), torch.ones(1, 4)), r"does not fit Two.forward\(x, y=None"),
    ({"z": torch.ones(1, 4)}, "missing a required argument: 'x'"),
    ({"x": torch.empty(1, 4, device="meta")}, "batch 0 holds a tensor on the meta device"),   # issue 46 #5
])
def test_a_bad_batch_is_one_line(bad, match):
    with pytest.raises(NormswapError, match=match) as e:
        as_batches(Two(), bad)
    assert "\n" not in str(e.value)


def test_positional_only_forward_is_refused_with_what_to_do():
    with pytest.raises(NormswapError, match=r"takes xs only by position .* wrap the model"):
        as_batches(Star(), (torch.ones(1),))


def test_no_config_and_no_examples_says_to_pass_them():
    with pytest.raises(NoInputs, match=r"cannot build sample inputs for Two \(not a transformers model.*"
                                        r"pass example_inputs"):
        model_inputs(Two())
    x = torch.randn(3, 4)
    assert len(model_inputs(Two(), x)) == 1 and torch.equal(model_inputs(Two(), x)[0]["x"], x)


def test_a_transformers_model_gets_its_samples_then_the_examples():
    m = tiny_model("gpt2")
    ids = torch.randint(0, 50, (1, 5))
    own = sample_inputs(m)
    got = model_inputs(m, [ids, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}])
    assert len(got) == len(own) + 2
    for a, b in zip(got, own):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))
    assert torch.equal(got[-2]["input_ids"], ids) and got[-1].keys() == {"input_ids", "attention_mask"}
