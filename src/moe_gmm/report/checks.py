"""Small comparison helpers that turn tensors into report rows.

"eager" is the per-expert loop (``fused=False``), the numerical truth; "fused" is the backend under
test. Every numeric check comes as up to two rows:

- ``rel err vs float64``: ``||out - ref|| / ||ref||`` for each path against the float64 reference
  of :mod:`moe_gmm.testing`, limit ``tolerance_for(dtype).rel``;
- ``max abs diff fused-eager``: the fused value against the eager one, passing when
  ``|fused - eager| <= atol + rtol * |eager|`` elementwise (``torch.allclose``) with the dtype's
  rtol/atol (bf16: 1e-2 / 1e-2, the reference unit test's tolerance).
"""

from __future__ import annotations

import torch

from moe_gmm.report.model import Row
from moe_gmm.testing import Tolerance, relative_error

__all__ = ["allclose_row", "dtype_name", "finite", "per_expert_max_abs", "rel_err_row", "worst_ratio"]


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
    section: str, check: str, eager: torch.Tensor, fused: torch.Tensor, ref: torch.Tensor, tol: Tolerance, notes: str = ""
) -> Row:
    # The float64 references of moe_gmm.testing live on the CPU; compare there.
    eager, fused, ref = eager.detach().cpu(), fused.detach().cpu(), ref.detach().cpu()
    err_e, err_f = relative_error(eager, ref), relative_error(fused, ref)
    ok = finite(eager) and finite(fused) and err_e <= tol.rel and err_f <= tol.rel
    return Row(section, check, "rel err vs float64", err_e, err_f, tol.rel, ok, notes)


def allclose_row(
    section: str, check: str, eager: torch.Tensor, fused: torch.Tensor, tol: Tolerance, notes: str = ""
) -> Row:
    if eager.shape != fused.shape:
        return Row(
            section, check, "max abs diff fused-eager", None, None, _tol_text(tol), False,
            f"shape mismatch: eager {tuple(eager.shape)} vs fused {tuple(fused.shape)}",
        )
    diff = (fused.detach().double() - eager.detach().double()).abs()
    max_abs = float(diff.max()) if diff.numel() else 0.0
    ratio = worst_ratio(fused, eager, tol)
    ok = finite(fused) and ratio <= 1.0
    extra = f"worst |d|/(atol+rtol|eager|) = {ratio:.3g}"
    return Row(section, check, "max abs diff fused-eager", None, max_abs, _tol_text(tol), ok,
               f"{notes}; {extra}" if notes else extra)


def per_expert_max_abs(fused_E: torch.Tensor, eager_E: torch.Tensor) -> list[float]:
    """max |fused[e] - eager[e]| for each expert of an ``[E, ...]`` tensor."""
    diff = (fused_E.detach().double() - eager_E.detach().double()).abs()
    return diff.reshape(diff.shape[0], -1).amax(dim=1).tolist() if diff.numel() else [0.0] * diff.shape[0]


def _tol_text(tol: Tolerance) -> str:
    return f"rtol={tol.rtol:g} atol={tol.atol:g}"
