"""Every registered CPU backend, called directly through the small backend interface."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_gmm.ops.backends import get_backend
from moe_gmm.testing import assert_rel_close, gmm_inputs, reference_grouped_matmul, reference_grouped_matmul_grads
from tests.helpers.gmm_cases import cpu_backend_names

BACKENDS = cpu_backend_names()

_COPY_OPS = {"clone", "copy_", "_to_copy", "contiguous", "clone.default"}


class _CountWeightCopies(TorchDispatchMode):
    """Counts ops that copy a tensor of the weight's size (the per-call copy the contract forbids)."""

    def __init__(self, weight_numel: int):
        super().__init__()
        self.weight_numel = weight_numel
        self.copies: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in _COPY_OPS and isinstance(out, torch.Tensor) and out.numel() == self.weight_numel:
            self.copies.append(str(func))
        return out


def _ends(counts):
    return torch.tensor(counts).cumsum(0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_transposed_weight_is_not_copied(backend):
    counts = [4, 0, 8, 4]
    x, w_view, _ = gmm_inputs(counts, 32, 48, transposed_weight=True)
    assert not w_view.is_contiguous()
    impl = get_backend(backend)
    dy = torch.randn(x.shape[0], 48)
    with _CountWeightCopies(w_view.numel()) as mode:
        y = impl.forward(x, w_view, _ends(counts))
        dx = impl.grad_input(dy, w_view, _ends(counts))
    assert mode.copies == [], f"{backend} copied the weight: {mode.copies}"
    assert_rel_close(y, reference_grouped_matmul(x, w_view, counts), 1e-5, "forward")
    dx_ref, _ = reference_grouped_matmul_grads(x, w_view, counts, dy)
    assert_rel_close(dx, dx_ref, 1e-5, "grad_input")


@pytest.mark.parametrize("backend", BACKENDS)
def test_direct_calls_write_everything_under_poison(backend, poisoned_memory):
    counts = [0, 7, 0, 0, 9, 0]
    x, w, _ = gmm_inputs(counts, 16, 32)
    dy = torch.randn(x.shape[0], 32)
    impl = get_backend(backend)
    y = impl.forward(x, w, _ends(counts))
    dx = impl.grad_input(dy, w, _ends(counts))
    dw = impl.grad_weight(x, dy, _ends(counts))
    dx_ref, dw_ref = reference_grouped_matmul_grads(x, w, counts, dy)
    assert_rel_close(y, reference_grouped_matmul(x, w, counts), 1e-5, "forward")
    assert_rel_close(dx, dx_ref, 1e-5, "grad_input")
    assert_rel_close(dw, dw_ref, 1e-5, "grad_weight")
    assert dw.shape == w.shape
    assert bool((dw[[0, 2, 3, 5]] == 0).all()), "empty experts' grad_weight must be exactly zero"


@pytest.mark.parametrize("backend", BACKENDS)
def test_int32_group_ends_accepted(backend):
    counts = [3, 5]
    x, w, _ = gmm_inputs(counts, 16, 16)
    y = get_backend(backend).forward(x, w, _ends(counts).to(torch.int32))
    assert_rel_close(y, reference_grouped_matmul(x, w, counts), 1e-5, "forward")
