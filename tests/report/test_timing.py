"""Times with their spread: quantiles, the noise flag, and profiler phases that fit in their step."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_gmm.layers import MoeBlockConfig, SparseMoeBlock
from moe_gmm.report.timing import (
    NOISY_MAX_OVER_MIN,
    NOISY_P80_OVER_P20,
    PROFILED_STEP,
    Spread,
    measure_phases,
    measure_phases_interleaved,
    ratio_range,
    spread_notes,
    wall_step_ms,
)

times = st.lists(st.floats(0.01, 1e4, allow_nan=False), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(samples=times)
def test_spread_matches_torch_quantiles_in_float64(samples):
    s = Spread.of(samples)
    t = torch.tensor(samples, dtype=torch.float64)
    expected = torch.quantile(t, torch.tensor([0.2, 0.5, 0.8], dtype=torch.float64)).tolist()
    assert s.repeats == len(samples)
    assert s.min == min(samples) and s.max == max(samples)
    for got, want in zip((s.p20, s.median, s.p80), expected):
        assert math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-12)
    assert s.min <= s.p20 <= s.median <= s.p80 <= s.max


def test_noise_flag_thresholds():
    quiet = Spread.of([10.0] * 9 + [10.0 * NOISY_MAX_OVER_MIN])  # max/min exactly at the limit
    assert not quiet.noisy and quiet.noise is None and "NOISY" not in quiet.describe()
    wide = Spread.of([10.0] * 9 + [10.0 * NOISY_MAX_OVER_MIN * 1.01])
    assert wide.noisy and wide.noise == "max/min 1.52x > 1.5"
    # Half the repeats slow: p80/p20 beyond its limit while max/min is below its own.
    bimodal = Spread.of([10.0] * 5 + [10.0 * NOISY_P80_OVER_P20 * 1.1] * 5)
    assert bimodal.noise == f"p80/p20 1.38x > {NOISY_P80_OVER_P20:g}"
    assert bimodal.describe().endswith("NOISY: p80/p20 1.38x > 1.25")
    assert Spread.of([3.0]).describe() == "median 3 ms (p20-p80 3-3, min-max 3-3, 1 repeat)"
    assert Spread.of([0.0, 0.0]).noise is None  # a zero time has no ratio to judge


@pytest.mark.parametrize("bad", [[], [1.0, float("nan")], [1.0, -2.0], [float("inf")]])
def test_spread_rejects_what_is_not_a_time(bad):
    with pytest.raises(ValueError, match="samples must"):
        Spread.of(bad)


def test_ratio_range_and_notes_put_noise_first():
    eager, fused = Spread.of([10, 11, 12, 13, 30]), Spread.of([5, 5, 5, 5, 5])
    low, high = ratio_range(eager, fused)
    assert low == pytest.approx(eager.p20 / fused.p80) and high == pytest.approx(eager.p80 / fused.p20)
    notes = spread_notes(eager, fused)
    assert notes.startswith("NOISY (eager max/min 3.00x > 1.5")
    assert "eager/fused 2.40x (from p20/p80: 2.16-3.28x)" in notes
    assert "fused p20-p80 5-5, min-max 5-5" in notes
    assert spread_notes(None, fused) == "fused p20-p80 5-5, min-max 5-5"


def _block_steps(seed: int = 0) -> dict:
    x = torch.randn(24, 32, generator=torch.Generator().manual_seed(seed))
    steps = {}
    for name, fused in (("eager", False), ("fused", True)):
        torch.manual_seed(seed)
        cfg = MoeBlockConfig(
            hidden_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            use_grouped_expert_matmul=fused,
        )
        block = SparseMoeBlock(cfg)

        def step(block=block) -> None:
            block.zero_grad(set_to_none=True)
            block(x).square().mean().backward()

        steps[name] = step
    return steps


def test_profiled_phases_fit_inside_the_profiled_step():
    rounds = 4
    phases = measure_phases_interleaved(_block_steps(), torch.device("cpu"), rounds=rounds)
    for name, ph in phases.items():
        assert set(ph) == {"gmm", "permute/unpermute", "host", PROFILED_STEP}
        assert all(s.repeats == rounds for s in ph.spreads.values()), name
        assert ph["gmm"] > 0 and ph["permute/unpermute"] > 0, name
        # Measured in the same steps: no phase can exceed the step that holds it.
        for phase in ("gmm", "permute/unpermute", "host"):
            assert ph.spreads[phase].max <= ph.spreads[PROFILED_STEP].max, (name, phase)
            assert ph[phase] <= ph[PROFILED_STEP], (name, phase)
            assert ph[phase] == ph.spreads[phase].median
    one = measure_phases(_block_steps()["fused"], torch.device("cpu"), steps=2)
    assert one.spreads[PROFILED_STEP].repeats == 2


def test_wall_step_ms_times_every_step_the_number_of_repeats():
    walls = wall_step_ms(_block_steps(), torch.device("cpu"), warmup=1, repeats=3)
    assert set(walls) == {"eager", "fused"}
    assert all(s.repeats == 3 and 0 < s.min <= s.median <= s.max for s in walls.values())
