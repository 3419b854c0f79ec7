"""The direct eager path: taken only when nothing observes the dispatcher, and equal to the ops."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import profile
from torch.utils._python_dispatch import TorchDispatchMode

from moe_gmm.layers import GroupedExperts
from moe_gmm.ops.eager_path import direct, label
from moe_gmm.ops.grouped_matmul import group_rows, grouped_matmul_rows


class _Seen(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


def test_direct_only_when_unobserved() -> None:
    t = torch.ones(2)
    assert direct(t, torch.nn.Parameter(torch.ones(2)))
    with _Seen():
        assert not direct(t)
    with profile():
        assert not direct(t)
    with torch.device("cpu"):  # a torch-function mode
        assert not direct(t)

    class Sub(torch.Tensor):
        pass

    assert not direct(t.as_subclass(Sub))


def test_label_is_free_unless_recording() -> None:
    assert not isinstance(label("moe::gmm"), torch.profiler.record_function)
    with profile():
        assert isinstance(label("moe::gmm"), torch.profiler.record_function)


def _step(experts: GroupedExperts, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor):
    for p in (*experts.parameters(), x, w):
        p.grad = None
    experts(x, ids, w).square().sum().backward()
    return [t.grad.clone() for t in (x, w, experts.gate_up_proj, experts.down_proj)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_direct_path_equals_the_ops_bitwise(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    experts = GroupedExperts(4, 32, 16).to(dtype)
    x = torch.randn(12, 32, generator=g).to(dtype).requires_grad_()
    ids = torch.randint(0, 4, (12, 2), generator=g)
    w = torch.rand(12, 2, generator=g).requires_grad_()
    direct_grads = _step(experts, x, ids, w)
    with _Seen() as seen:  # a dispatch mode: the custom ops run, and are seen
        op_grads = _step(experts, x, ids, w)
    assert {"moe_gmm::grouped_matmul", "moe_gmm::permute", "moe_gmm::unpermute", "moe_gmm::swiglu"} <= set(seen.names)
    for a, b in zip(direct_grads, op_grads):
        assert torch.equal(a, b)


def test_group_rows_checked_once_and_rechecked_after_a_change() -> None:
    x, weight = torch.randn(6, 8, dtype=torch.float64), torch.randn(3, 8, 4, dtype=torch.float64)
    rows = group_rows(torch.tensor([1, 2, 3]), num_experts=3, num_rows=6, device=x.device, validate=False)
    assert rows.bounds == (0, 1, 3, 6)
    expected = torch.cat([x[0:1] @ weight[0], x[1:3] @ weight[1], x[3:6] @ weight[2]])
    # float64 on the eager loop: the same per-expert products as the reference, to rounding
    torch.testing.assert_close(grouped_matmul_rows(x, weight, rows, "eager"), expected, rtol=1e-12, atol=1e-12)
    rows.ends[1] = 7  # an in-place change: the remembered bounds no longer hold
    with pytest.raises(ValueError, match="group_list"):
        grouped_matmul_rows(x, weight, rows, "eager")


def test_group_rows_refuses_a_list_that_does_not_tile() -> None:
    with pytest.raises(ValueError, match="group_list"):
        group_rows(torch.tensor([1, 2, 2]), num_experts=3, num_rows=6, device=torch.device("cpu"), validate=False)
