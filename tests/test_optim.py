"""make_adamw: the fused AdamW kernel where the device has it, else a fallback."""

from __future__ import annotations

import pytest
import torch

from moe_gmm.optim import adamw_kind, make_adamw
from tests.helpers.profiling import op_names


def test_make_adamw_is_fused_on_cpu_and_runs_the_fused_kernel():
    p = torch.nn.Parameter(torch.randn(4, 8))
    p.grad = torch.randn(4, 8)
    fused = make_adamw([p], lr=1e-3, weight_decay=0.1)
    assert adamw_kind(fused) == "fused" and fused.defaults["weight_decay"] == 0.1
    assert "aten::_fused_adamw_" in op_names(fused.step)
    plain = torch.optim.AdamW([p], lr=1e-3)
    assert adamw_kind(plain) == "for-loop"
    assert "aten::_fused_adamw_" not in op_names(plain.step)


def test_make_adamw_falls_back_where_no_fused_kernel_exists():
    # The meta device has neither the fused nor the multi-tensor kernels.
    p = torch.nn.Parameter(torch.empty(4, 8, device="meta"))
    assert adamw_kind(make_adamw([p], lr=1e-3)) == "for-loop"
    with pytest.raises(ValueError, match="fused"):
        make_adamw([p], lr=1e-3, fused=False)
