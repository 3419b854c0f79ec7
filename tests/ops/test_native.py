"""The native CPU kernels: build and load, agreement with the composed torch ops and float64, fallback."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_gmm import permute, swiglu, unpermute
from moe_gmm.ops import native
from moe_gmm.testing import (
    assert_rel_close,
    reference_permute,
    reference_swiglu,
    reference_unpermute,
    reference_unpermute_grads,
    routing_ids,
    tolerance_for,
)

needs_kernels = pytest.mark.skipif(
    native.compiler() is None or not native.enabled(), reason="no C++ compiler here, or MOE_GMM_NATIVE=0"
)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _round_trip(num_tokens, top_k, num_experts, hidden, dtype, seed, *, grads=(True, True)):
    """permute -> unpermute forward and backward; returns every output and gradient."""
    g = torch.Generator().manual_seed(seed)
    ids = routing_ids(num_tokens, top_k, num_experts, "duplicate_topk", generator=g)
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype).requires_grad_(True)
    probs = torch.rand(num_tokens, top_k, generator=g).requires_grad_(grads[1])
    permuted, row_id_map, _ = permute(x, ids, num_experts)
    expert_out = (permuted * 1.5).detach().requires_grad_(grads[0])
    out = unpermute(expert_out, row_id_map, probs)
    grad_out = torch.randn(out.shape, generator=g).to(dtype)
    leaves = [t for t in (expert_out, probs) if t.requires_grad]
    dexpert, dprobs = torch.autograd.grad(out, leaves, grad_out) if len(leaves) == 2 else (None, None)
    if len(leaves) == 1:
        (only,) = torch.autograd.grad(out, leaves, grad_out)
        dexpert, dprobs = (only, None) if grads[0] else (None, only)
    (dx,) = torch.autograd.grad(permuted, x, expert_out.detach())
    return {
        "ids": ids,
        "x": x,
        "probs": probs,
        "expert_out": expert_out,
        "grad_out": grad_out,
        "out": out,
        "d_expert_out": dexpert,
        "d_probs": dprobs,
        "d_x": dx,
    }


@needs_kernels
def test_kernels_build_and_load():
    assert native.available(), native.unavailable_reason()
    assert native.library_path().exists()
    for name in ("permute_rows", "slot_sum", "unpermute_backward", "swiglu", "swiglu_backward"):
        assert hasattr(torch.ops.moe_gmm_native, name)
    assert native.ops(torch.empty(1, dtype=torch.bfloat16)) is not None
    assert native.ops(torch.empty(1, dtype=torch.float64)) is None, "float64 stays on the composed path"
    with native.disabled():
        assert native.ops(torch.empty(1)) is None


# Tokens, hidden size, dtype and seed of the hypothesis tests over permute/unpermute.
_ROWS = {
    "num_tokens": st.integers(1, 40),
    "hidden": st.integers(1, 70),
    "dtype": st.sampled_from(DTYPES),
    "seed": st.integers(0, 10_000),
}


@needs_kernels
@settings(max_examples=30, deadline=None)
@given(
    top_k=st.integers(1, 8),
    num_experts=st.integers(1, 300),
    id_dtype=st.sampled_from((torch.int32, torch.int64)),
    **_ROWS,
)
def test_native_permute_is_the_composed_permute_bit_for_bit(
    num_tokens, top_k, num_experts, hidden, dtype, id_dtype, seed
):
    g = torch.Generator().manual_seed(seed)
    # Skewed ids: many experts empty, some with many rows, duplicates within a token.
    ids = (torch.rand(num_tokens, top_k, generator=g) ** 3 * num_experts).long().clamp_(max=num_experts - 1)
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    got = permute(x, ids.to(id_dtype), num_experts)
    with native.disabled():
        composed = permute(x, ids.to(id_dtype), num_experts)
    for a, b, name in zip(got, composed, ("permuted", "row_id_map", "tokens_per_expert")):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(
            a.view(torch.uint8) if a.is_floating_point() else a, b.view(torch.uint8) if b.is_floating_point() else b
        ), name


@needs_kernels
@pytest.mark.parametrize("bad", [-1, 4])
def test_native_permute_rejects_an_id_outside_the_experts_unvalidated(bad):
    # validate=False skips the Python range check; the kernel still refuses (a ValueError) instead of writing out of bounds.
    ids = torch.tensor([[0, 1], [bad, 2]])
    with pytest.raises(ValueError, match=r"expert id .* outside \[0, 4\)"):
        permute(torch.randn(2, 8), ids, 4, validate=False)


@needs_kernels
@settings(max_examples=20, deadline=None)
@given(top_k=st.integers(1, 4), num_experts=st.integers(1, 6), **_ROWS)
def test_permute_unpermute_native_matches_composed_and_float64(num_tokens, top_k, num_experts, hidden, dtype, seed):
    got = _round_trip(num_tokens, top_k, num_experts, hidden, dtype, seed)
    with native.disabled():
        composed = _round_trip(num_tokens, top_k, num_experts, hidden, dtype, seed)
    _, rows, _ = reference_permute(got["x"], got["ids"], num_experts)
    rows_Tk = rows.view(num_tokens, top_k)
    ref_out = reference_unpermute(got["expert_out"], rows_Tk, got["probs"])
    ref_dy, ref_dp = reference_unpermute_grads(got["expert_out"], rows_Tk, got["probs"], got["grad_out"])
    ones = torch.ones(num_tokens, top_k, dtype=torch.float64)
    ref_dx = reference_unpermute(got["expert_out"], rows_Tk, ones)
    limit = tolerance_for(dtype).rel
    for key, ref in (("out", ref_out), ("d_expert_out", ref_dy), ("d_x", ref_dx)):
        assert_rel_close(got[key], ref, limit, f"native {key}")
        # Both accumulate in float32 and round once: they differ by at most an output rounding.
        assert_rel_close(got[key], composed[key].double(), limit, f"native vs composed {key}")
    if dtype == torch.float32:
        for key in ("out", "d_expert_out", "d_x"):
            assert_rel_close(got[key], composed[key].double(), 1e-6, f"native vs composed {key} (fp32)")
    # d_probs are dot products over the hidden size, summed in float32: in any order they may differ
    # from the exact sum by up to about hidden * eps * sum |terms|, which cancellation makes large
    # next to the dot itself (hidden 66, one token: 4e-6 of the largest value on an AMD EPYC; hidden
    # 69, four of one token's dots: 1.1e-5 of their norm), plus the rounding to the output dtype.
    expert_out_Tkh = got["expert_out"].double()[rows_Tk]
    terms_Tk = (got["grad_out"].double()[:, None, :] * expert_out_Tkh).abs().sum(-1)
    summing_Tk = hidden * torch.finfo(torch.float32).eps * terms_Tk
    rounding_Tk = torch.finfo(dtype).eps * ref_dp.abs()
    for what, d_probs in (("native", got["d_probs"]), ("composed", composed["d_probs"])):
        diff_Tk = (d_probs.double() - ref_dp).abs()
        assert bool((diff_Tk <= summing_Tk + rounding_Tk).all()), f"{what} d_probs: {diff_Tk.max()} over the bound"
    if dtype == torch.float32:
        diff_Tk = (got["d_probs"].double() - composed["d_probs"].double()).abs()
        within = bool((diff_Tk <= 2 * summing_Tk).all())
        assert within, f"native vs composed d_probs (fp32): {diff_Tk.max()} over the bound"


@needs_kernels
@pytest.mark.parametrize("grads", [(True, False), (False, True)], ids=["expert_out_only", "probs_only"])
def test_unpermute_backward_computes_only_what_is_needed(grads):
    got = _round_trip(9, 3, 4, 20, torch.bfloat16, 0, grads=grads)
    with native.disabled():
        composed = _round_trip(9, 3, 4, 20, torch.bfloat16, 0, grads=grads)
    for key in ("d_expert_out", "d_probs"):
        if composed[key] is None:
            assert got[key] is None
        else:
            assert_rel_close(got[key], composed[key].double(), 1e-2, key)


@needs_kernels
@settings(max_examples=15, deadline=None)
@given(
    rows=st.integers(0, 50),
    inter=st.integers(1, 80),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 10_000),
)
def test_swiglu_native_matches_composed_and_float64(rows, inter, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, 2 * inter, generator=g) * 3).to(dtype)
    dy = torch.randn(rows, inter, generator=g).to(dtype)

    def run():
        leaf = x.clone().requires_grad_(True)
        y = swiglu(leaf)
        (dx,) = torch.autograd.grad(y, leaf, dy)
        return y, dx

    y, dx = run()
    with native.disabled():
        y_c, dx_c = run()
    x64 = x.double().requires_grad_(True)
    y64 = reference_swiglu(x64)
    (dx64,) = torch.autograd.grad(y64, x64, dy.double())
    limit = tolerance_for(dtype).rel
    assert_rel_close(y, y64, limit, "swiglu")
    assert_rel_close(dx, dx64, limit, "swiglu grad")
    assert_rel_close(y, y_c.double(), limit, "swiglu native vs composed")
    assert_rel_close(dx, dx_c.double(), limit, "swiglu grad native vs composed")


@needs_kernels
def test_strided_inputs_are_read_correctly():
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(6, 20, generator=g, dtype=torch.bfloat16)
    x = wide[:, 2:14]  # rows 20 apart: not contiguous
    assert not x.is_contiguous()
    assert_rel_close(swiglu(x), reference_swiglu(x), tolerance_for(torch.bfloat16).rel, "strided swiglu")
    expert_out = torch.randn(12, 30, generator=g)[:, ::3]  # [12, 10], column stride 3
    probs = torch.rand(6, 2, generator=g)
    row_id_map = torch.randperm(12, generator=g)
    out = unpermute(expert_out, row_id_map, probs)
    assert_rel_close(out, reference_unpermute(expert_out, row_id_map.view(6, 2), probs), 1e-6, "strided unpermute")


@needs_kernels
def test_results_do_not_depend_on_the_thread_count():
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            r = _round_trip(300, 4, 8, 96, torch.bfloat16, 7)
            x = torch.randn(500, 160, generator=torch.Generator().manual_seed(1), dtype=torch.bfloat16)
            results.append([r["out"], r["d_expert_out"], r["d_probs"], r["d_x"], swiglu(x)])
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def _run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


_FALLBACK_CHECK = """
    import warnings
    import torch
    from moe_gmm import permute, swiglu, unpermute
    from moe_gmm.ops import native
    from moe_gmm.testing import reference_unpermute, reference_swiglu
    x = torch.randn(8, 6)
    ids = torch.randint(0, 3, (8, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        permuted, row_id_map, _ = permute(x, ids, 3)
        out = unpermute(permuted, row_id_map, torch.ones(8, 2))
        y = swiglu(x)
    assert torch.allclose(out.double(), 2 * x.double(), rtol=1e-6, atol=1e-6)
    assert torch.allclose(y.double(), reference_swiglu(x), rtol=1e-6, atol=1e-6)
    print("AVAILABLE", native.available(), "REASON", native.unavailable_reason())
    print("WARNINGS", [str(w.message) for w in caught])
"""


def test_a_failing_build_falls_back_to_the_torch_path(tmp_path):
    done = _run_python(_FALLBACK_CHECK, CXX="false", MOE_GMM_NATIVE_DIR=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "AVAILABLE False" in done.stdout
    assert "failed" in done.stdout and "native CPU kernels unavailable" in done.stdout
    assert not list(tmp_path.glob("*.so")), "a failed build must not leave a library behind"


@pytest.mark.skipif(
    native.compiler() is None or platform.machine().lower() not in ("x86_64", "amd64"),
    reason="needs a C++ compiler targeting x86-64",
)
def test_sources_compile_for_an_x86_cpu_without_avx512():
    # The library is built with -march=native, which here may enable AVX-512 and hide code that
    # only compiles with it; on a CPU without it (AVX2 only) the whole build would then fail and
    # every native path fall back to torch. Each kernel must reduce to its fallbacks there.
    flags = [flag for flag in native._flags() if flag != "-march=native"] + ["-march=x86-64-v3", "-fsyntax-only"]
    runs = {
        source.name: subprocess.Popen(
            [native.compiler(), str(source), *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for source in native.SOURCES
    }
    for name, run in runs.items():
        _, err = run.communicate(timeout=600)
        assert run.returncode == 0, f"{name} does not compile without AVX-512:\n{err[-3000:]}"


def test_turned_off_by_environment(tmp_path):
    done = _run_python(_FALLBACK_CHECK, MOE_GMM_NATIVE="0", MOE_GMM_NATIVE_DIR=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "WARNINGS []" in done.stdout  # nothing was tried, so nothing to warn about
    assert not list(tmp_path.iterdir()), "turned off: nothing may be built"


@needs_kernels
def test_swiglu_saturates_like_float64_for_large_gates():
    # exp's exponent is clamped to the normal range: far out, silu(g) must still be ~0 or ~g.
    gate = torch.cat([torch.linspace(-300, 300, 601), torch.tensor([-88.7, -87.3, 87.3, 88.7, 0.0])])
    x = torch.cat([gate[:, None].repeat(1, 4), torch.full((gate.numel(), 4), 1.5)], 1)  # [n, 8]: gate | up
    x64 = x.double().requires_grad_(True)
    y64 = reference_swiglu(x64)
    dy = torch.ones(y64.shape, dtype=torch.float64)
    (dx64,) = torch.autograd.grad(y64, x64, dy)
    leaf = x.clone().requires_grad_(True)
    y = swiglu(leaf)
    (dx,) = torch.autograd.grad(y, leaf, dy.float())
    assert torch.isfinite(y).all() and torch.isfinite(dx).all()
    torch.testing.assert_close(y.double(), y64, rtol=1e-5, atol=1e-30)
    torch.testing.assert_close(dx.double(), dx64, rtol=1e-5, atol=1e-30)


def test_cpuinfo_value_reads_the_first_matching_line():
    from pathlib import Path

    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        assert native.cpuinfo_value("flags") is None
        return
    lines = [line for line in cpuinfo.read_text().splitlines() if line.startswith(("flags", "Features"))]
    expected = lines[0].split(":", 1)[1].strip() if lines else None
    assert native.cpuinfo_value("flags", "Features") == expected
    assert native.cpuinfo_value("no such field in cpuinfo") is None


@needs_kernels
@pytest.mark.parametrize("bad", [-1, 6, 10**9])
def test_kernels_refuse_row_ids_outside_the_rows(bad):
    # The Python side checks unless told not to; the kernels never index memory with a bad id.
    assert native.available(), native.unavailable_reason()
    kernels = torch.ops.moe_gmm_native
    src, probs, grad_out = torch.randn(6, 4), torch.rand(3, 2), torch.randn(3, 4)
    row_id_map = torch.arange(6)
    row_id_map[4] = bad
    with pytest.raises(ValueError, match=rf"slot_sum: row_id_map\[4\] = {bad} outside \[0, 6\)"):
        kernels.slot_sum(src, row_id_map, probs, 2, torch.empty(3, 4))
    with pytest.raises(ValueError, match=rf"unpermute_backward: row_id_map\[4\] = {bad} outside \[0, 6\)"):
        kernels.unpermute_backward(grad_out, src, row_id_map, probs, torch.empty(6, 4), torch.empty(3, 2))
