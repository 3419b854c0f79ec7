"""The benchmark tables: every time cell carries its spread, and a wide one is flagged NOISY."""

from __future__ import annotations

import pytest

from moe_gmm.bench.harness import timing_from_samples
from moe_gmm.bench.table import _cell, _noisy


def _row(samples: list[float]) -> dict:
    t = timing_from_samples(samples)
    return {
        "median_s": t.median_s, "min_s": t.min_s, "p20_s": t.p20_s, "p80_s": t.p80_s, "max_s": t.max_s,
        "repeats": t.repeats, "x_floor": 1.25,
    }  # fmt: skip


def test_timing_keeps_the_slowest_repeat() -> None:
    assert timing_from_samples([0.3, 0.1, 0.2]).max_s == pytest.approx(0.3)


def test_a_steady_cell_shows_median_and_p20_p80() -> None:
    row = _row([0.010, 0.0101, 0.0102, 0.0103, 0.0104])
    assert not _noisy(row)
    assert _cell(row) == "10.2 [10.1-10.3] (1.25x)"


@pytest.mark.parametrize(
    "samples",
    [
        [0.010, 0.010, 0.010, 0.010, 0.020],  # one stalled repeat: max/min 2
        [0.010, 0.010, 0.013, 0.016, 0.016],  # a wide middle: p80/p20 1.6
    ],
)
def test_a_wide_spread_is_flagged(samples: list[float]) -> None:
    assert _noisy(_row(samples))
    assert _cell(_row(samples)).endswith("NOISY")


def test_a_skipped_row_has_no_time() -> None:
    assert _cell({"median_s": None}) == "skip"
