"""Row builders of the measurement table: pass, fail and shape mismatch."""

from __future__ import annotations

import torch

from moe_gmm.report.checks import allclose_row, rel_diff_row
from moe_gmm.testing import tolerance_for

TOL = tolerance_for(torch.bfloat16)


def test_identical_tensors_pass_with_zero_difference():
    a = torch.randn(4, 8)
    for build in (allclose_row, rel_diff_row):
        row = build("s", "c", a, a.clone(), TOL)
        assert row.fused == 0.0 and row.passed is True


def test_a_wrong_expert_block_fails_both_rows():
    eager = torch.randn(6, 8)
    fused = eager.clone()
    fused[2:4] = 0.0  # one expert's rows dropped
    assert allclose_row("s", "c", eager, fused, TOL).passed is False
    assert rel_diff_row("s", "c", eager, fused, TOL).passed is False


def test_shape_mismatch_fails_and_says_so():
    for build in (allclose_row, rel_diff_row):
        row = build("s", "c", torch.zeros(4, 8), torch.zeros(4, 9), TOL)
        assert row.passed is False and row.fused is None
        assert "shape mismatch: eager (4, 8) vs fused (4, 9)" in row.notes
