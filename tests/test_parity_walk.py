"""What parity, the trace and the lazy loader share: one walk over a forward's outputs (names, caches, the
residual-stream tuples left out) and one retry of a batch row by row."""
from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicCache

from normswap.parity import by_rows, floating_outputs, tensors, tensors_in


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


def test_a_batch_that_fails_runs_row_by_row():
    calls = []

    def one_row_only(batch):
        calls.append(batch["x"].shape[0])
        if batch["x"].shape[0] > 1:
            raise ValueError("one row at a time")
        return int(batch["x"])

    batch = {"x": torch.tensor([[3], [4]]), "flag": True}
    runs = by_rows(one_row_only, batch)
    assert [r for _, r in runs] == [3, 4] and calls == [2, 1, 1]
    assert runs[1][0]["flag"] is True and runs[1][0]["x"].shape == (1, 1)
    one = {"x": torch.tensor([[5]])}
    assert by_rows(one_row_only, one) == [(one, 5)]   # a batch that runs: as it is


def test_the_batch_error_is_raised_when_rows_do_not_help():
    def never(batch):
        raise ValueError(f"rows {batch['x'].shape[0]}")

    with pytest.raises(ValueError, match="rows 2"):   # rows fail too: the batch's own error
        by_rows(never, {"x": torch.zeros(2, 1)})
    with pytest.raises(ValueError, match="rows 1"):   # one row already: nothing to retry
        by_rows(never, {"x": torch.zeros(1, 1)})
