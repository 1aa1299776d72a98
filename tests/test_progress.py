"""Progress bars: a manual bar never counts past its total, so the percentage stays (issue 33 #15)."""
from __future__ import annotations

from normswap import progress


def test_a_manual_bar_stops_at_its_total_and_shows_a_percentage():
    with progress.bar(total=498, desc="convert", unit="B", unit_scale=True, enabled=True) as shown:
        shown.update(400)
        shown.update(252)   # a tensor read twice: the estimate falls short of the work
        assert shown.n == 498 and "100%" in str(shown) and "652" not in str(shown)


def test_off_by_default_draws_nothing(capsys):
    with progress.bar(total=10) as shown:
        shown.update(20)
        shown.set_postfix(loss="1")
    assert capsys.readouterr().err == ""
