"""The check the ``cpu`` backend's tests share: one forward + backward against float64 and eager."""

from __future__ import annotations

import torch

from moe_gmm import grouped_matmul
from moe_gmm.testing import (
    assert_rel_close,
    gmm_inputs,
    reference_grouped_matmul,
    reference_grouped_matmul_grads,
    tolerance_for,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def check_cpu(
    counts: list[int],
    k: int,
    n: int,
    dtype: torch.dtype,
    *,
    transposed_weight: bool = False,
    seed: int = 0,
    expanded_grad: bool = False,
) -> None:
    """The ``cpu`` backend's three passes vs float64 and vs the eager backend; empty experts' grad_weight zero."""
    x, w, group_list = gmm_inputs(counts, k, n, dtype, transposed_weight=transposed_weight, seed=seed)
    tol = tolerance_for(dtype)
    dy = torch.randn(x.shape[0], n, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    if expanded_grad:
        dy = torch.ones(1, 1, dtype=dtype).expand(x.shape[0], n)
    results = {}
    for backend in ("eager", "cpu"):
        x_ = x.detach().clone().requires_grad_(True)
        w_ = w.detach().clone() if not transposed_weight else w.detach().transpose(1, 2).clone().transpose(1, 2)
        w_.requires_grad_(True)
        y = grouped_matmul(x_, w_, group_list, backend=backend)
        y.backward(dy)
        results[backend] = (y.detach(), x_.grad, w_.grad)
    y_ref = reference_grouped_matmul(x, w, counts)
    dx_ref, dw_ref = reference_grouped_matmul_grads(x, w, counts, dy)
    for what, got, ref, eager in zip(
        ("forward", "grad_input", "grad_weight"), results["cpu"], (y_ref, dx_ref, dw_ref), results["eager"]
    ):
        assert got.dtype == dtype and got.shape == ref.shape
        assert_rel_close(got, ref, tol.rel, f"cpu {what} vs float64")
        # Two correct float32 sums of a long reduction in different orders differ by about the eager
        # loop's own error against float64 where the terms cancel to small outputs (1100 terms:
        # above 1e-5 for MKL's loop against a dot-product kernel in 4 of 61 random cases), so twice
        # that error widens atol (the register blocks: 0 of 141 such cases past it, at most 0.4).
        slack = (
            2 * (eager.double() - ref.double()).abs().max().item() if dtype == torch.float32 and ref.numel() else 0.0
        )
        torch.testing.assert_close(got, eager, rtol=tol.rtol, atol=tol.atol + slack, msg=f"cpu {what} vs eager")
    dw = results["cpu"][2]
    for e, c in enumerate(counts):
        if c == 0:
            assert bool((dw[e] == 0).all()), f"expert {e} has no rows: its grad_weight must be exactly zero"


def same_at_every_thread_count(call) -> None:
    """``call()`` gives the same bits on 1, 2 and 3 intra-op threads."""
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append(call())
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(r, results[0]) for r in results[1:])
