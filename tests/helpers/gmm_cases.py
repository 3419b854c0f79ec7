"""Shared case runner for grouped-matmul tests: one forward + backward checked three ways."""

from __future__ import annotations

import torch

from moe_gmm import grouped_matmul
from moe_gmm.ops.backends import registered_backends
from moe_gmm.testing import (
    assert_rel_close,
    gmm_inputs,
    reference_grouped_matmul,
    reference_grouped_matmul_grads,
    tolerance_for,
)


def cpu_backend_names() -> list[str]:
    """Every registered backend that can run on CPU tensors in this process."""
    probe_x, probe_w = torch.zeros(16, 16), torch.zeros(2, 16, 16)
    return sorted(name for name, b in registered_backends().items() if b.refusal(probe_x, probe_w) is None)


def backend_accepts(name: str, x: torch.Tensor, w: torch.Tensor) -> bool:
    return registered_backends()[name].refusal(x, w) is None


def run_and_check(
    counts: list[int],
    k: int,
    n: int,
    dtype: torch.dtype,
    *,
    backend: str | None = None,
    transposed_weight: bool = False,
    group_list_type: str = "count",
    seed: int = 0,
) -> None:
    """Forward and backward through ``grouped_matmul``: vs float64, and vs the eager backend.

    A backend that declines these inputs (e.g. torch's grouped_mm with K not 16-byte aligned) is
    replaced by ``auto``, which must then find another one: the contract holds on every input.
    """
    x, w, group_list = gmm_inputs(counts, k, n, dtype, transposed_weight=transposed_weight, seed=seed)
    if backend is not None and not backend_accepts(backend, x, w):
        backend = None
    if group_list_type == "cumsum":
        group_list = torch.cumsum(group_list, 0)
    tol = tolerance_for(dtype)
    g = torch.Generator().manual_seed(seed + 1)
    dy = torch.randn(x.shape[0], n, generator=g, dtype=torch.float64).to(dtype)

    outputs = {}
    for name in ("eager", backend or "auto"):
        x_ = x.clone().requires_grad_(True)
        w_ = w.detach().clone() if not transposed_weight else w.detach().transpose(1, 2).clone().transpose(1, 2)
        w_.requires_grad_(True)
        y = grouped_matmul(x_, w_, group_list, group_list_type=group_list_type, backend=name)
        assert y.shape == (x.shape[0], n) and y.dtype == dtype
        y.backward(dy)
        assert x_.grad.shape == x.shape and w_.grad.shape == w.shape
        outputs[name] = (y.detach(), x_.grad, w_.grad)

    y_ref = reference_grouped_matmul(x, w, counts)
    dx_ref, dw_ref = reference_grouped_matmul_grads(x, w, counts, dy)
    for name, (y, dx, dw) in outputs.items():
        assert_rel_close(y, y_ref, tol.rel, f"{name} forward")
        assert_rel_close(dx, dx_ref, tol.rel, f"{name} grad_input")
        assert_rel_close(dw, dw_ref, tol.rel, f"{name} grad_weight")
        for e, c in enumerate(counts):
            if c == 0:
                assert bool((dw[e] == 0).all()), f"{name}: empty expert {e} grad_weight not exactly zero"
    fused, eager = outputs[backend or "auto"], outputs["eager"]
    for what, a, b in zip(("forward", "grad_input", "grad_weight"), fused, eager):
        torch.testing.assert_close(a, b, rtol=tol.rtol, atol=tol.atol, msg=lambda m, what=what: f"{what}: {m}")
