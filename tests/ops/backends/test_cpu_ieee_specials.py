"""Every path of the ``cpu`` backend exact under IEEE specials: +Inf, -Inf and NaN in x, the weight
and grad_output, against the float64 loop.

A special may reach only the outputs its operand enters in exact arithmetic. A kernel that masks
a lane, a padding row or half of a pair by multiplying it by zero turns a neighbour's Inf into NaN
(0 * Inf), so the checks want NaN exactly where the float64 reference has NaN, the same
infinities, and the finite values within a bound from the reference's own conditioning.

Each family is put in force with ``use_tuning`` and the profiler shows which kernel ran; the
families that need AMX or AVX-512 skip only where the CPU or build lacks them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch.profiler import ProfilerActivity, profile

from moe_gmm import permute, swiglu, unpermute
from moe_gmm.ops.backends import cpu
from moe_gmm.testing import (
    gmm_inputs,
    reference_grouped_matmul,
    reference_grouped_matmul_grads,
    reference_permute,
    reference_swiglu,
    reference_unpermute,
    routing_ids,
)
from tests.helpers.cpu_checks import assert_ieee_close, native_family_missing, sum_error_bound

INF = float("inf")
SPECIALS = (INF, -INF, float("nan"))
_NATIVE = "moe_gmm_native::"
# Everything torch-only: no native kernel, no experts_mm.
_TORCH_ONLY = {"use_amx": False, "use_avx512_bf16": False, "use_avx512": False, "use_experts_mm": False}
_EVERY_ROW_COUNT = 10**9  # a row limit no expert reaches: the kernel takes every expert


@dataclass(frozen=True)
class Family:
    """One way the backend runs the three passes: the tuning that forces it, the operator each pass
    must run (forward, grad_input, grad_weight of an ``[E, K, N]`` weight; any one of a set), and the
    shapes it takes."""

    name: str
    dtype: torch.dtype
    needs: str | None  # "amx", "avx512_bf16", "avx512", "native" or None (torch only)
    tuning: Mapping[str, object]
    ops: tuple[frozenset[str], frozenset[str], frozenset[str]]
    max_rows: int  # rows an expert gets here, from 0
    aligned: bool  # widths multiples of 32 (the bfloat16 kernels' contract)
    swaps_with_layout: bool = True  # a transposed weight swaps the forward's and grad_input's kernels
    forbidden: frozenset[str] = field(default_factory=frozenset)  # operators that must not run

    def expected(self, w: torch.Tensor, transposed_weight: bool) -> tuple[frozenset[str], ...]:
        fwd, gin, gw = self.ops
        if self.swaps_with_layout and min(w.shape[1:]) == 1:  # a width of 1: both strides are unit ones
            return fwd | gin, fwd | gin, gw
        return (gin, fwd, gw) if transposed_weight and self.swaps_with_layout else (fwd, gin, gw)


def _native(*names: str) -> tuple[frozenset[str], ...]:
    return tuple(frozenset({_NATIVE + n}) for n in names)


def _bf16_limits(prefix: str) -> dict[str, int]:
    names = ("nn_max_rows", "nt_max_rows", "grad_weight_max_rows")
    return {f"{prefix}_{n}": _EVERY_ROW_COUNT for n in names}


_LOOP_OPS = frozenset({"aten::_grouped_mm", "aten::mm"})
_AMX_OPS = _native("amx_gemm_nn", "amx_gemm_nt", "amx_gemm_tn")
FAMILIES = [
    # AMX nn for experts of at most 16 rows (spread_product) and above (chunked_product), nt, tn.
    Family("amx_16_rows", torch.bfloat16, "amx", _bf16_limits("amx"), _AMX_OPS, 16, True),
    Family("amx", torch.bfloat16, "amx", _bf16_limits("amx"), _AMX_OPS, 80, True),
    Family(
        "avx512_bf16",
        torch.bfloat16,
        "avx512_bf16",
        {"use_amx": False, **_bf16_limits("avx512_bf16")},
        _native("avx512_bf16_gemm_nn", "avx512_bf16_gemm_nt", "avx512_bf16_gemm_tn"),
        70,
        True,
    ),
    Family(
        "avx512_fp32",
        torch.float32,
        "avx512",
        {"avx512_nn_max_rows": _EVERY_ROW_COUNT, "avx512_nt_max_rows": _EVERY_ROW_COUNT,
         "avx512_grad_weight_max_rows": _EVERY_ROW_COUNT},
        _native("avx512_gemm_nn_few_rows", "avx512_gemm_nt_few_rows", "avx512_gemm_tn"),
        40,
        False,
    ),
    *(
        Family(
            f"experts_mm_{str(dtype).removeprefix('torch.')}",
            dtype,
            "native",
            {**_TORCH_ONLY, "use_experts_mm": True, "experts_mm_min_experts_fp32": 1},
            _native("experts_mm", "experts_mm", "experts_mm_tn"),
            70,
            False,
            swaps_with_layout=False,
        )
        for dtype in (torch.float32, torch.bfloat16, torch.float16)
    ),
    *(
        Family(
            f"padded_bmm_{str(dtype).removeprefix('torch.')}",
            dtype,
            None,
            {**_TORCH_ONLY, "min_threads": 1, "min_experts": 1, "max_rows_fp32": 1 << 30, "max_pad_waste": 1e9},
            (frozenset({"aten::bmm"}),) * 3,
            40,
            False,
            swaps_with_layout=False,
            forbidden=frozenset({_NATIVE + "experts_mm", _NATIVE + "experts_mm_tn"}),
        )
        for dtype in (torch.float32, torch.bfloat16, torch.float16)
    ),
    *(
        Family(
            f"gemm_loop_{str(dtype).removeprefix('torch.')}",
            dtype,
            None,
            {**_TORCH_ONLY, "min_experts": _EVERY_ROW_COUNT},
            (_LOOP_OPS,) * 3,
            40,
            False,
            swaps_with_layout=False,
            forbidden=frozenset({"aten::bmm", _NATIVE + "experts_mm", _NATIVE + "experts_mm_tn"}),
        )
        for dtype in (torch.float32, torch.bfloat16, torch.float16)
    ),
]


@pytest.fixture(params=FAMILIES, ids=lambda f: f.name)
def family(request):
    """Each family, in force for the test; skipped only where this CPU or build cannot run it."""
    f = request.param
    reason = native_family_missing(f.needs) if f.needs else None
    if reason:
        pytest.skip(reason)
    with cpu.use_tuning(**f.tuning):
        yield f


def _profiled(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, set[str]]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, {e.key for e in prof.key_averages()}


def _finite_abs(t: torch.Tensor) -> torch.Tensor:
    """|t| in float64 with every special as 0: the terms that make a finite output's conditioning."""
    return t.double().abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _check_passes(f: Family, x, w, dy, counts: list[int], transposed_weight: bool) -> None:
    """The three passes by the ``cpu`` backend against the float64 loop, each run by f's kernel."""
    ends = torch.tensor(counts, dtype=torch.int64).cumsum(0)
    y_ref = reference_grouped_matmul(x, w, counts)
    dx_ref, dw_ref = reference_grouped_matmul_grads(x, w, counts, dy)
    y_abs = reference_grouped_matmul(_finite_abs(x), _finite_abs(w), counts)
    dx_abs, dw_abs = reference_grouped_matmul_grads(_finite_abs(x), _finite_abs(w), counts, _finite_abs(dy))
    gmm = torch.ops.moe_gmm
    passes = (
        ("forward", lambda: gmm.grouped_matmul(x, w, ends, "cpu"), y_ref, y_abs, x.shape[1]),
        ("grad_input", lambda: gmm.grouped_matmul_grad_input(dy, w, ends, "cpu"), dx_ref, dx_abs, dy.shape[1]),
        ("grad_weight", lambda: gmm.grouped_matmul_grad_weight(x, dy, ends, "cpu"), dw_ref, dw_abs, max(counts)),
    )
    for (what, run, ref, abs_ref, depth), expected in zip(passes, f.expected(w, transposed_weight), strict=True):
        got, ran = _profiled(run)
        assert ran & expected, f"{f.name} {what}: expected one of {sorted(expected)} to run, ran {sorted(ran)}"
        assert not ran & f.forbidden, f"{f.name} {what}: {sorted(ran & f.forbidden)} ran"
        assert_ieee_close(got, ref, sum_error_bound(ref, abs_ref, depth, f.dtype), f"{f.name} {what}")


def _place(t: torch.Tensor, index: tuple[int, ...], value: float) -> None:
    t[index] = value  # through a transposed view too: the weight's storage is what the kernels read


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_every_pass_is_exact_under_specials(family, data):
    # Row counts from 0 (empty experts) past the kernels' tiles, blocks and dot groups; widths past
    # a panel for the bfloat16 kernels, and any width (masked tails) for the others.
    counts = data.draw(st.lists(st.integers(0, family.max_rows), min_size=1, max_size=6), label="counts")
    assume(sum(counts) > 0)
    widths = st.sampled_from([32, 64, 96, 288, 544]) if family.aligned else st.integers(1, 150)
    k, n = data.draw(widths, label="k"), data.draw(widths, label="n")
    transposed_weight = data.draw(st.booleans(), label="transposed_weight")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    x, w, _ = gmm_inputs(counts, k, n, family.dtype, transposed_weight=transposed_weight, seed=seed)
    dy = torch.randn(x.shape[0], n, generator=torch.Generator().manual_seed(seed + 1)).to(family.dtype)
    shapes = {"x": x.shape, "w": w.shape, "dy": dy.shape}
    for _ in range(data.draw(st.integers(1, 4), label="specials")):
        name = data.draw(st.sampled_from(sorted(shapes)), label="operand")
        index = tuple(data.draw(st.integers(0, size - 1), label=f"{name} index") for size in shapes[name])
        _place({"x": x, "w": w, "dy": dy}[name], index, data.draw(st.sampled_from(SPECIALS), label="value"))
    _check_passes(family, x, w, dy, counts, transposed_weight)


@pytest.mark.parametrize("transposed_weight", [False, True], ids=["EKN", "ENK"])
def test_specials_next_to_every_expert_edge(family, transposed_weight):
    # The masking bug's own case (an Inf in one weight column made its neighbour NaN) and the rows
    # either side of every group boundary, where padding and tails are read; an empty expert too.
    counts = [min(c, family.max_rows) for c in (1, 0, 4, 16, 17, 33, 3)]
    k, n = (64, 96) if family.aligned else (37, 70)
    x, w, _ = gmm_inputs(counts, k, n, family.dtype, transposed_weight=transposed_weight, seed=3)
    dy = torch.randn(x.shape[0], n, generator=torch.Generator().manual_seed(4)).to(family.dtype)
    for e in range(len(counts)):
        _place(w, (e, 3, 5), INF)  # column 5's neighbours 4 and 6 share its pairs and lanes
        _place(w, (e, k - 1, n - 1), float("nan"))
    ends = [0, *torch.tensor(counts).cumsum(0).tolist()]
    for i, end in enumerate(ends[1:-1]):
        if end > 0:
            _place(x, (end - 1, i % k), -INF)  # an expert's last row
            _place(dy, (end - 1, (2 * i + 1) % n), INF)
        if end < x.shape[0]:
            _place(dy, (end, i % n), float("nan"))  # the next expert's first row
    _check_passes(family, x, w, dy, counts, transposed_weight)


@pytest.mark.parametrize("transposed_weight", [False, True], ids=["EKN", "ENK"])
def test_specials_in_an_expert_of_hundreds_of_rows(family, transposed_weight):
    # Past experts_mm's 512 rows its GEMMs run on the expert's rows as they are (no scratch), and
    # grad_weight's reduction is the row count itself, 531 here: unaligned for 16-bit GEMMs.
    counts = [3, 531, 0, 20]
    k, n = (64, 96) if family.aligned else (37, 70)
    x, w, _ = gmm_inputs(counts, k, n, family.dtype, transposed_weight=transposed_weight, seed=7)
    dy = torch.randn(x.shape[0], n, generator=torch.Generator().manual_seed(8)).to(family.dtype)
    for row, col, value in [(3, 0, INF), (200, k - 1, float("nan")), (201, 1, -INF), (533, 2, INF)]:
        _place(x, (row, col % k), value)
        _place(dy, (row + 1, (col + 1) % n), value)
    _place(w, (1, k // 2, n // 2), -INF)
    _check_passes(family, x, w, dy, counts, transposed_weight)


# ---- the glue kernels (permute / unpermute / swiglu), on the native path and the composed one ------


@pytest.mark.usefixtures("glue_path")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_permute_and_unpermute_carry_specials(dtype):
    g = torch.Generator().manual_seed(5)
    ids = routing_ids(12, 2, 4, "uneven", generator=g)
    hidden = torch.randn(12, 40, generator=g).to(dtype)
    for (t, h), v in zip([(0, 0), (3, 17), (11, 39), (6, 16)], SPECIALS + (INF,)):
        hidden[t, h] = v
    permuted, row_id_map, counts = permute(hidden, ids, 4)
    ref_permuted, rows, ref_counts = reference_permute(hidden, ids, 4)
    assert torch.equal(counts, ref_counts)
    # a row copy moves bits: NaN where the reference has NaN, everything else equal
    assert_ieee_close(permuted, ref_permuted, 0.0, "permute")
    probs = torch.rand(12, 2, generator=g)
    out = unpermute(permuted, row_id_map, probs)
    ref = reference_unpermute(permuted, rows, probs)
    ref_abs = reference_unpermute(_finite_abs(permuted), rows, probs)
    assert_ieee_close(out, ref, sum_error_bound(ref, ref_abs, 2, dtype), "unpermute")


@pytest.mark.usefixtures("glue_path")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_swiglu_carries_specials(dtype):
    # silu(+Inf) = +Inf, silu(-Inf) = -Inf * 0 = NaN, a NaN gate or up NaN; an Inf up times silu(g).
    inter = 24
    x = torch.randn(6, 2 * inter, generator=torch.Generator().manual_seed(6)).to(dtype)
    for row, (gate, up) in enumerate([(INF, None), (-INF, None), (float("nan"), None), (None, INF), (None, -INF)]):
        if gate is not None:
            x[row, row + 3] = gate
        if up is not None:
            x[row, inter + row + 3] = up
    x[5, 0], x[5, inter + 1] = 100.0, -100.0  # large finite gates saturate, they do not overflow
    ref = reference_swiglu(x)
    # a few float32 roundings (exp within 2 ulp, the sigmoid's sum and quotient, the products) and
    # the output's rounding, relative to the value
    u32, u_out = torch.finfo(torch.float32).eps / 2, torch.finfo(dtype).eps / 2
    assert_ieee_close(swiglu(x), ref, (u_out + 16 * u32) * ref.abs(), "swiglu")
