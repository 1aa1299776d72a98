"""Every module's own train/eval flag is what it was after normswap ran the model (trace, rehearsal,
verification, trial forwards), not the top module's flag spread over the whole tree by `train()`."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import normswap
from normswap.models.inputs.runs import run
from normswap.models.modes import eval_mode
from normswap.norms import RMSNorm
from helpers.exact_models import perturb

V, D = 50, 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.fc, self.drop = nn.LayerNorm(D), nn.Linear(D, D), nn.Dropout(0.5)

    def forward(self, x):
        return x + self.drop(self.fc(self.ln(x)))


class Model(nn.Module):
    """Pre-LN blocks and a final norm: exact-convertible. Dropout is on while training, so that a module left
    in the wrong mode changes the outputs."""

    def __init__(self):
        super().__init__()
        self.embed, self.blocks, self.ln_f = nn.Embedding(V, D), nn.ModuleList([Block(), Block()]), nn.LayerNorm(D)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)


def mixed() -> Model:
    """The top module training, block 0 in eval (its norm too), block 1's norm alone in eval."""
    torch.manual_seed(0)
    model = perturb(Model()).train()
    model.blocks[0].eval()
    model.blocks[1].ln.eval()
    return model


def flags(model: nn.Module) -> dict[str, bool]:
    return {name: m.training for name, m in model.named_modules()}


def test_eval_mode_restores_each_flag_even_on_error():
    model = mixed()
    before = flags(model)
    with pytest.raises(RuntimeError), eval_mode(model, None):
        assert not any(flags(model).values())
        raise RuntimeError("inside")
    assert flags(model) == before
    assert before["blocks.0.drop"] is False and before["blocks.1.drop"] is True   # the test means something


@pytest.mark.parametrize("method", ["naive", "exact", "auto"])
def test_convert_keeps_every_flag(method):
    model = mixed()
    before = flags(model)
    report = normswap.convert(model, method=method, example_inputs=[torch.randint(0, V, (2, 5))])
    assert report.method == ("naive" if method == "naive" else "exact")
    assert flags(model) == before
    # the new norms take the replaced ones' flags
    assert [type(model.blocks[i].ln) for i in (0, 1)] == [RMSNorm, RMSNorm]
    assert (model.blocks[0].ln.training, model.blocks[1].ln.training, model.ln_f.training) == (False, False, True)


def test_a_trial_forward_keeps_every_flag():
    model = mixed()
    before = flags(model)
    assert run(model, {"ids": torch.randint(0, V, (2, 5))}) == ""
    assert flags(model) == before
