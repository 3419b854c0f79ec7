"""The ``npu`` backend's plumbing, run against the CPU emulator of the vendor contract.

``npu_emulator`` implements the documented semantics of ``torch_npu.npu_grouped_matmul``; the
backend built over it by ``make_npu_backend`` is registered under a test name on CPU, so the public
op (custom ops, autograd, group-list handling) runs end to end. Real-hardware tests at the end run
only where torch_npu imports and an NPU exists.
"""

from __future__ import annotations

import pytest
import torch

from moe_gmm import grouped_matmul
from moe_gmm.ops.backends import get_backend, register_backend, unregister_backend
from moe_gmm.ops.backends.npu import make_npu_backend
from moe_gmm.testing import (
    assert_rel_close,
    gmm_inputs,
    reference_grouped_matmul,
    reference_grouped_matmul_grads,
    tolerance_for,
)
from tests.helpers import npu_emulator


@pytest.fixture(params=["cumsum", "count"])
def emulated(request):
    """The npu backend over the emulator, registered as ``npu_emulated_<type>`` for one test."""
    backend = make_npu_backend(
        npu_emulator, name=f"npu_emulated_{request.param}", devices=frozenset({"cpu"}), group_list_type=request.param
    )
    register_backend(backend)
    yield backend
    unregister_backend(backend.name)


def _forward_backward(counts, k, n, dtype, backend, *, transposed=False):
    x, w, group_list = gmm_inputs(counts, k, n, dtype, transposed_weight=transposed)
    x.requires_grad_(True)
    w.requires_grad_(True)
    y = grouped_matmul(x, w, group_list, backend=backend)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(dtype)
    y.backward(dy)
    return x, w, dy, y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "counts,transposed",
    [([5, 0, 9, 3], False), ([0, 6, 0, 0, 4, 0], True), ([4, 4], False)],
    ids=["empty-middle", "mostly-empty-transposed", "two-even"],
)
def test_matches_reference_and_eager(emulated, counts, transposed, dtype):
    x, w, dy, y = _forward_backward(counts, 24, 40, dtype, emulated.name, transposed=transposed)
    limit = tolerance_for(dtype).rel
    ref_dx, ref_dw = reference_grouped_matmul_grads(x, w, counts, dy)
    assert_rel_close(y, reference_grouped_matmul(x, w, counts), limit, "y")
    assert_rel_close(x.grad, ref_dx, limit, "dx")
    assert_rel_close(w.grad, ref_dw, limit, "dw")
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.equal(w.grad[e], torch.zeros_like(w.grad[e])), f"expert {e}: grad_weight must be 0"
    x_e, w_e = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    y_e = grouped_matmul(x_e, w_e, counts, backend="eager")
    y_e.backward(dy)
    tol = tolerance_for(dtype)
    for got, want in ((y, y_e), (x.grad, x_e.grad), (w.grad, w_e.grad)):
        torch.testing.assert_close(got, want, rtol=tol.rtol, atol=tol.atol)


def test_vendor_call_arguments(emulated, monkeypatch):
    """The exact arguments of the reference system: split_item / group_type / group_list_type."""
    calls = []
    real = npu_emulator.npu_grouped_matmul

    def spy(x, weight, **kwargs):
        calls.append((len(x), tuple(x[0].shape), tuple(weight[0].shape), kwargs["split_item"], kwargs["group_type"],
                      kwargs["group_list_type"], kwargs["group_list"].tolist()))  # fmt: skip
        return real(x, weight, **kwargs)

    monkeypatch.setattr(npu_emulator, "npu_grouped_matmul", spy)
    _forward_backward([3, 0, 5], 16, 24, torch.float32, emulated.name)
    list_type = 0 if emulated.name.endswith("cumsum") else 1
    group_list = [3, 3, 8] if list_type == 0 else [3, 0, 5]
    assert calls == [
        (1, (8, 16), (3, 16, 24), 2, 0, list_type, group_list),  # forward
        (1, (8, 24), (3, 24, 16), 2, 0, list_type, group_list),  # grad_input on the [E, N, K] view
        (1, (16, 8), (8, 24), 3, 2, list_type, group_list),  # grad_weight, k grouped over x^T
    ]


def test_empty_expert_grad_weight_zeroed_over_unspecified_vendor_output(emulated):
    """The emulator returns NaN for a k-group without rows (undocumented); the backend zeroes it."""
    x, w, _ = gmm_inputs([4, 0, 3], 16, 8)
    dy = torch.randn(7, 8)
    ends = torch.tensor([4, 4, 7])
    (raw,) = npu_emulator.npu_grouped_matmul(
        [x.t()], [dy], group_list=ends, split_item=3, group_type=2, group_list_type=0
    )
    assert torch.isnan(raw[1]).all()
    dw = emulated.grad_weight(x, dy, ends)
    assert torch.equal(dw[1], torch.zeros_like(dw[1]))
    assert_rel_close(dw, reference_grouped_matmul_grads(x, w, [4, 0, 3], torch.cat([dy]))[1], 1e-5, "dw")


def test_zero_rows(emulated):
    x, w, _ = gmm_inputs([0, 0], 16, 8)
    w.requires_grad_(True)
    y = grouped_matmul(x, w, [0, 0], backend=emulated.name)
    y.sum().backward()
    assert y.shape == (0, 8) and torch.equal(w.grad, torch.zeros_like(w))


def test_vendor_limits_raise_clear_errors(emulated):
    # One row each: an empty problem never reaches the kernel, so its limits would not apply.
    too_many = torch.zeros(1025, 4, 4)
    with pytest.raises(ValueError, match="at most 1024 groups"):
        grouped_matmul(torch.zeros(1, 4), too_many, [1] + [0] * 1024, backend=emulated.name)
    wide = torch.zeros(2, 65536, 1)
    with pytest.raises(ValueError, match="K and N < 65536"):
        grouped_matmul(torch.zeros(1, 65536), wide, [1, 0], backend=emulated.name)
    with pytest.raises(ValueError, match="dtype float64"):
        grouped_matmul(torch.zeros(2, 4, dtype=torch.float64), torch.zeros(2, 4, 4, dtype=torch.float64), [1, 1],
                       backend=emulated.name)  # fmt: skip
    x, w, _ = gmm_inputs([5], 8, 8)
    if emulated.name.endswith("count"):
        with pytest.raises(ValueError, match="group list of length 1"):
            grouped_matmul(x, w, [5], backend=emulated.name)
    else:  # the cumsum form has no such restriction
        assert_rel_close(grouped_matmul(x, w, [5], backend=emulated.name), reference_grouped_matmul(x, w, [5]), 1e-5)


def test_make_npu_backend_rejects_unknown_group_list_type():
    with pytest.raises(ValueError, match="group_list_type"):
        make_npu_backend(npu_emulator, group_list_type="offsets")


# ---------------------------------------------------------------------------------------------
# The emulator itself: the documented modes the backend does not use, and the vendor errors.
# ---------------------------------------------------------------------------------------------


def test_emulator_split_items_and_group_types():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 5, generator=g)
    w = torch.randn(2, 5, 3, generator=g)
    # split_item 1 (single x split by group_list, one output per group) vs 3 (one output)
    ys = npu_emulator.npu_grouped_matmul([x], [w], group_list=torch.tensor([3, 4]), split_item=1, group_type=0,
                                         group_list_type=1)  # fmt: skip
    assert [tuple(y.shape) for y in ys] == [(3, 3), (4, 3)]
    (y,) = npu_emulator.npu_grouped_matmul([x], [w[0], w[1]], group_list=torch.tensor([3, 7]), split_item=3,
                                           group_type=0, group_list_type=0)  # fmt: skip
    torch.testing.assert_close(y, torch.cat(ys))
    # split_item 0 / 2 with group_type -1: independent x tensors
    xs = [x[:3], x[3:]]
    ys0 = npu_emulator.npu_grouped_matmul(xs, [w], split_item=0, group_type=-1)
    (y2,) = npu_emulator.npu_grouped_matmul(xs, [w], split_item=2, group_type=-1)
    torch.testing.assert_close(torch.cat(ys0), y2)
    torch.testing.assert_close(y2, torch.cat([x[:3] @ w[0], x[3:] @ w[1]]))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(group_list=torch.tensor([7]), group_list_type=1), "length other than 1"),
        (dict(group_list=torch.tensor([3, 3]), group_list_type=1), "covers 6 of 7"),
        (dict(group_list=torch.tensor([5, 3]), group_list_type=0), "non-decreasing"),
        (dict(group_list=torch.tensor([3, 4], dtype=torch.int32), group_list_type=1), "int64"),
    ],
)
def test_emulator_vendor_errors(kwargs, match):
    x, w = torch.randn(7, 4), torch.randn(len(kwargs["group_list"]), 4, 2)
    with pytest.raises(npu_emulator.NpuContractError, match=match):
        npu_emulator.npu_grouped_matmul([x], [w], split_item=2, group_type=0, **kwargs)


# ---------------------------------------------------------------------------------------------
# Real hardware
# ---------------------------------------------------------------------------------------------

_NPU_REASON = get_backend("npu").unavailable_reason()


@pytest.mark.skipif(_NPU_REASON is not None, reason=f"no Ascend NPU here: {_NPU_REASON}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_real_npu_forward_backward(dtype):
    counts = [40, 0, 17, 64, 1]
    x, w, group_list = gmm_inputs(counts, 128, 96, dtype, device="npu", transposed_weight=True)
    x.requires_grad_(True)
    w.requires_grad_(True)
    y = grouped_matmul(x, w, group_list.to("npu"), backend="npu")
    dy = torch.randn(y.shape, dtype=torch.float64).to(y)
    y.backward(dy)
    limit = tolerance_for(dtype).rel
    ref_dx, ref_dw = reference_grouped_matmul_grads(x, w, counts, dy)
    assert_rel_close(y.cpu(), reference_grouped_matmul(x, w, counts), limit, "y")
    assert_rel_close(x.grad.cpu(), ref_dx, limit, "dx")
    assert_rel_close(w.grad.cpu(), ref_dw, limit, "dw")
    assert torch.equal(w.grad[1].cpu(), torch.zeros_like(w.grad[1].cpu()))
