"""The reference's outputs kept on disk (`io.spill`, as streaming keeps them): the same comparison, number for
number, with no output held in memory; outputs of several dims per position and views compared block by block."""
from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

from normswap.io.spill import Spill, Spilled
from normswap.parity import compare, reading, reference_outputs


class Shapes(nn.Module):
    """Logits, per-position heads (batch, length, 3, 4), a view that is not contiguous, a width-0 slot, a
    scalar."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head, self.heads = nn.Embedding(10, 4), nn.Linear(4, 10), nn.Linear(4, 12)

    def forward(self, input_ids, attention_mask=None):
        h = self.emb(input_ids)
        return {"logits": self.head(h), "heads": self.heads(h).view(*h.shape[:2], 3, 4),
                "keys": h.transpose(1, 2), "slot": h[..., :0], "scale": h.sum()}


def batches():
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, 3:] = 0
    return [{"input_ids": torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]]), "attention_mask": mask},
            {"input_ids": torch.arange(9)[None] % 10, "attention_mask": torch.ones(1, 9, dtype=torch.long)}]


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_spilled_reference_compares_exactly_as_one_in_memory(tmp_path, dtype):
    model = Shapes().to(dtype)
    changed = copy.deepcopy(model)
    changed.heads.bias += 0.25
    changed.emb.weight[9] += 1.0   # only at padded positions of the first batch: masked out there
    in_memory = compare(model, changed, batches())
    with Spill(tmp_path) as spill:
        ref = reference_outputs(model, batches(), spill=spill)
        assert all(isinstance(v, Spilled) for out in ref.outputs for v in out.values())
        assert os.listdir(tmp_path) == []   # unlinked: never seen in the folder
        again = reference_outputs(model, batches())
        for out, mem in zip(ref.outputs, again.outputs):
            assert out.keys() == mem.keys()
            for k in out:
                with reading(out[k]) as (v, drop):
                    assert v.dtype == mem[k].dtype and v.shape == mem[k].shape and torch.equal(v, mem[k]), k
                    drop()   # the pages read go; reading again reads the file
                    assert torch.equal(v, mem[k]), k
        on_disk = compare(model, changed, batches(), spill=spill)
    assert on_disk == in_memory
    assert in_memory.outputs["heads"]["max_abs"] > 0 and in_memory.outputs["slot"]["max_abs"] == 0.0
    # masked per position: the first batch's padded rows (token 0) differ nowhere but through emb[9]: unseen
    x = batches()
    a, b = model(**x[0])["heads"].double(), changed(**x[0])["heads"].double()
    keep = x[0]["attention_mask"].bool()
    d0 = (a[keep] - b[keep]).abs().max()
    a1, b1 = model(**x[1])["heads"].double(), changed(**x[1])["heads"].double()
    d = max(d0, (a1 - b1).abs().max()).item()
    assert in_memory.outputs["heads"]["max_abs"] == d
