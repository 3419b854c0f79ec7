"""Comparison functions that turn tensors into report rows.

"eager" is the per-expert loop (``fused=False``), the numerical truth; "fused" is the backend under
test. Every numeric check comes as up to two rows:

- ``rel err vs float64``: ``||out - ref|| / ||ref||`` for each path against the float64 reference
  of :mod:`moe_gmm.testing`, limit ``tolerance_for(dtype).rel``;
- fused against eager, in one of two forms:
  - ``max abs diff fused-eager`` (one grouped matmul): passes when
    ``|fused - eager| <= atol + rtol * |eager|`` elementwise (``torch.allclose``) with the dtype's
    rtol/atol (bf16: 1e-2 / 1e-2, the reference unit test's tolerance);
  - ``rel diff fused-eager`` (a block of several ops): ``||fused - eager|| / ||eager||`` against
    ``tolerance_for(dtype).rel``. Two bf16 pipelines that round their intermediates at different
    points (another backend, transformers' own loop) differ by a few ulps in single elements, which
    an elementwise 1e-2 cannot absorb after several ops; the norm-wise bound stays meaningful and
    still flags a wrong or missing expert (a relative difference of order 0.1 to 1).
"""

from __future__ import annotations

import torch

from moe_gmm.report.model import Row
from moe_gmm.testing import Tolerance, relative_error

__all__ = [
    "allclose_row",
    "dtype_name",
    "empty_zero_row",
    "finite",
    "per_expert_max_abs",
    "per_expert_row",
    "rel_diff_row",
    "rel_err_row",
    "worst_ratio",
]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def finite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t.detach()).all())


def worst_ratio(fused: torch.Tensor, eager: torch.Tensor, tol: Tolerance) -> float:
    """max over elements of ``|fused - eager| / (atol + rtol |eager|)``; <= 1 means allclose."""
    f, e = fused.detach().double(), eager.detach().double()
    if f.numel() == 0:
        return 0.0
    return float(((f - e).abs() / (tol.atol + tol.rtol * e.abs())).max())


def rel_err_row(
    section: str,
    check: str,
    eager: torch.Tensor,
    fused: torch.Tensor,
    ref: torch.Tensor,
    tol: Tolerance,
    notes: str = "",
    *,
    judge_eager: bool = True,
) -> Row:
    """Both paths against the float64 reference; ``judge_eager=False`` reports the eager column
    without holding it to the limit (when eager is a third-party implementation)."""
    # The float64 references of moe_gmm.testing live on the CPU; compare there.
    eager, fused, ref = eager.detach().cpu(), fused.detach().cpu(), ref.detach().cpu()
    err_e, err_f = relative_error(eager, ref), relative_error(fused, ref)
    ok = finite(fused) and err_f <= tol.rel and (not judge_eager or (finite(eager) and err_e <= tol.rel))
    return Row(section, check, "rel err vs float64", err_e, err_f, tol.rel, ok, notes)


def _shape_mismatch_row(
    section: str, check: str, metric: str, tolerance, eager: torch.Tensor, fused: torch.Tensor
) -> Row:
    notes = f"shape mismatch: eager {tuple(eager.shape)} vs fused {tuple(fused.shape)}"
    return Row(section, check, metric, None, None, tolerance, False, notes)


def _max_abs_diff(fused: torch.Tensor, eager: torch.Tensor) -> float:
    diff = (fused.detach().double() - eager.detach().double()).abs()
    return float(diff.max()) if diff.numel() else 0.0


def allclose_row(
    section: str, check: str, eager: torch.Tensor, fused: torch.Tensor, tol: Tolerance, notes: str = ""
) -> Row:
    if eager.shape != fused.shape:
        return _shape_mismatch_row(section, check, "max abs diff fused-eager", _tol_text(tol), eager, fused)
    max_abs = _max_abs_diff(fused, eager)
    ratio = worst_ratio(fused, eager, tol)
    ok = finite(fused) and ratio <= 1.0
    extra = f"worst |d|/(atol+rtol|eager|) = {ratio:.3g}"
    return Row(
        section,
        check,
        "max abs diff fused-eager",
        None,
        max_abs,
        _tol_text(tol),
        ok,
        f"{notes}; {extra}" if notes else extra,
    )


def rel_diff_row(
    section: str, check: str, eager: torch.Tensor, fused: torch.Tensor, tol: Tolerance, notes: str = ""
) -> Row:
    """``||fused - eager|| / ||eager||`` against ``tol.rel``; the max abs diff goes in the notes."""
    if eager.shape != fused.shape:
        return _shape_mismatch_row(section, check, "rel diff fused-eager", tol.rel, eager, fused)
    rel = relative_error(fused, eager)
    max_abs = _max_abs_diff(fused, eager)
    extra = f"max abs diff {max_abs:.3g}"
    return Row(
        section,
        check,
        "rel diff fused-eager",
        None,
        rel,
        tol.rel,
        finite(fused) and rel <= tol.rel,
        f"{notes}; {extra}" if notes else extra,
    )


def per_expert_max_abs(fused_E: torch.Tensor, eager_E: torch.Tensor) -> list[float]:
    """max |fused[e] - eager[e]| for each expert of an ``[E, ...]`` tensor."""
    diff = (fused_E.detach().double() - eager_E.detach().double()).abs()
    return diff.reshape(diff.shape[0], -1).amax(dim=1).tolist() if diff.numel() else [0.0] * diff.shape[0]


def _tol_text(tol: Tolerance) -> str:
    return f"rtol={tol.rtol:g} atol={tol.atol:g}"


def per_expert_row(
    section: str,
    check: str,
    dw_e: torch.Tensor,
    dw_f: torch.Tensor,
    counts,
    tol: Tolerance,
    *,
    elementwise: bool = True,
) -> Row:
    """The worst expert of an ``[E, ...]`` gradient, fused against eager.

    ``elementwise``: every element within ``atol + rtol |eager|`` (one grouped matmul); otherwise
    each expert's ``||fused[e] - eager[e]|| / ||eager[e]||`` within ``tol.rel`` (a block). An
    expert whose eager gradient is exactly zero must have a fused gradient of exactly zero.
    """
    per_expert = per_expert_max_abs(dw_f, dw_e)
    f, e = dw_f.detach().double(), dw_e.detach().double()
    num_experts = f.shape[0]
    if elementwise:
        bound = tol.atol + tol.rtol * e.abs()
        score_E = ((f - e).abs() / bound).reshape(num_experts, -1).amax(dim=1)
        value, metric, limit = (
            max(per_expert),
            "max abs diff fused-eager (max over experts)",
            f"rtol={tol.rtol:g} atol={tol.atol:g}",
        )
    else:
        diff_E = (f - e).reshape(num_experts, -1).norm(dim=1)
        ref_E = e.reshape(num_experts, -1).norm(dim=1)
        rel_E = torch.where(ref_E > 0, diff_E / ref_E.clamp_min(1e-300), torch.where(diff_E > 0, torch.inf, 0.0))
        score_E = rel_E / tol.rel
        value, metric, limit = float(rel_E.max()), "rel diff fused-eager (max over experts)", tol.rel
    worst = int(score_E.argmax())
    failing = [x for x in range(num_experts) if not score_E[x] <= 1.0]
    ok = finite(dw_f) and not failing
    notes = (
        "every expert bitwise identical"
        if max(per_expert) == 0.0
        else f"worst expert {worst} ({int(counts[worst])} rows)"
    )
    if failing:
        notes += f"; failing experts {failing}"
    return Row(
        section,
        check,
        metric,
        None,
        value,
        limit,
        ok,
        notes,
        details={"per_expert_max_abs": per_expert, "counts": [int(c) for c in counts], "worst_expert": worst},
    )


def empty_zero_row(section: str, check: str, dw_e: torch.Tensor, dw_f: torch.Tensor, empty: list[int]) -> Row:
    """Experts that received no rows must get a gradient of exactly zero on both paths."""
    nz_e = [e for e in empty if bool((dw_e[e] != 0).any())]
    nz_f = [e for e in empty if bool((dw_f[e] != 0).any())]
    max_e = max((float(dw_e[e].abs().max()) for e in empty), default=0.0)
    max_f = max((float(dw_f[e].abs().max()) for e in empty), default=0.0)
    ok = not nz_e and not nz_f and all(bool(torch.isfinite(dw_f[e]).all()) for e in empty)
    notes = f"empty experts {empty}"
    if nz_e or nz_f:
        notes += f"; nonzero: eager {nz_e}, fused {nz_f}"
    return Row(section, check, "max |grad| over empty experts", max_e, max_f, "exactly 0", ok, notes)
