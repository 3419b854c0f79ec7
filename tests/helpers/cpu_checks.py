"""What the ``cpu`` backend's tests share: one forward + backward against float64 and eager, the
IEEE-aware comparison with a float64 reference, and why a native kernel family cannot run here."""

from __future__ import annotations

import torch

from moe_gmm import grouped_matmul
from moe_gmm.ops import native
from moe_gmm.ops.backends import cpu
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


def native_family_missing(family: str) -> str | None:
    """Why the native kernels of ``family`` (``"native"``: any of them, ``"amx"``, ``"avx512_bf16"``,
    ``"avx512"``) cannot run on this CPU and build, or None when they can."""
    if not native.enabled():
        return "native kernels turned off by MOE_GMM_NATIVE"
    if native.compiler() is None:
        return "no C++ compiler here: the native kernels cannot be built"
    assert native.available(), native.unavailable_reason()  # a compiler whose build fails is an error
    ops = native.ops()
    if family == "amx" and not cpu.amx_available():
        return "the AMX kernels need an x86 CPU with AMX-BF16 and an OS that grants the tiles"
    if family == "avx512_bf16" and not ops.avx512_bf16_gemm_supported():
        return "the AVX-512 BF16 kernels need an x86 CPU with AVX512_BF16"
    if family == "avx512" and not ops.avx512_gemm_supported():
        return "the AVX-512 float32 kernels need an x86 CPU with AVX-512F"
    return None


def sum_error_bound(ref: torch.Tensor, abs_ref: torch.Tensor, terms: int, dtype: torch.dtype) -> torch.Tensor:
    """The most a float32 sum of ``terms`` products may differ from its exact value ``ref`` once rounded
    to ``dtype``: gamma_(terms + 1) * abs_ref (any summation order, each product rounded at most once;
    abs_ref the sum of the terms' magnitudes, the sum's conditioning) plus the output's rounding."""
    u32 = torch.finfo(torch.float32).eps / 2
    gamma = (terms + 1) * u32 / (1 - (terms + 1) * u32)
    u_out = torch.finfo(dtype).eps / 2
    # + a denormal per term (AMX flushes denormal results to zero) + half the output's subnormal step
    subnormal_step = torch.finfo(dtype).tiny * torch.finfo(dtype).eps
    return (
        u_out * ref.abs()
        + (1 + u_out) * gamma * abs_ref
        + (terms + 1) * torch.finfo(torch.float32).tiny
        + subnormal_step / 2
    )


def _positions(mask: torch.Tensor, got: torch.Tensor, ref: torch.Tensor, limit: int = 5) -> str:
    idx = mask.nonzero()[:limit].tolist()
    return ", ".join(f"{tuple(i)}: got {got[tuple(i)].item()}, ref {ref[tuple(i)].item()}" for i in idx)


def assert_ieee_close(got: torch.Tensor, ref: torch.Tensor, allowed: torch.Tensor | float, what: str) -> None:
    """``got`` against the float64 ``ref``: NaN exactly where ref has NaN, the same infinities, and
    every finite value within ``allowed`` (an absolute error, per element or one for all)."""
    if got.shape != ref.shape:
        raise AssertionError(f"{what}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}")
    got64, ref64 = got.detach().double(), ref.detach().double()
    nan_differs = got64.isnan() != ref64.isnan()
    if bool(nan_differs.any()):
        raise AssertionError(f"{what}: {int(nan_differs.sum())} elements NaN on one side only: "
                             f"{_positions(nan_differs, got64, ref64)}")
    both = ~ref64.isnan()
    inf_differs = both & (got64.isinf() | ref64.isinf()) & (got64 != ref64)
    if bool(inf_differs.any()):
        where = _positions(inf_differs, got64, ref64)
        raise AssertionError(f"{what}: {int(inf_differs.sum())} infinities differ: {where}")
    finite = ref64.isfinite()
    allowed64 = torch.as_tensor(allowed, dtype=torch.float64).expand_as(ref64)
    too_far = finite & ((got64 - ref64).abs() > allowed64)
    if bool(too_far.any()):
        raise AssertionError(f"{what}: {int(too_far.sum())} finite elements past the error bound: "
                             f"{_positions(too_far, got64, ref64)}")
