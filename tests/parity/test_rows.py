"""What parity, the trace and the lazy loader share: one retry of a batch row by row."""
from __future__ import annotations

import pytest
import torch

from normswap.parity.rows import by_rows


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
