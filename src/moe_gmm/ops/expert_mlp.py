"""The routed experts' two matmuls: ``GMM(x, gate_up) -> swiglu -> GMM(., down)``.

Legend: R permuted rows (grouped by expert), H hidden, I expert intermediate size, E experts.

This is the one function that runs the routed experts; the layer, the expert-parallel dispatcher
(on its local tokens and local experts) and the Hugging Face integration all call it. Weights may
be strided views: Hugging Face stores ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` and
passes ``.transpose(1, 2)`` views, which the grouped matmul reads in place (no copy per step).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.profiler import record_function

from moe_gmm.ops.grouped_matmul import GroupListType, grouped_matmul
from moe_gmm.ops.swiglu import swiglu

__all__ = ["expert_mlp"]


def expert_mlp(
    x_RH: torch.Tensor,
    group_list_E: torch.Tensor | Sequence[int],
    gate_up_EH2I: torch.Tensor,
    down_EIH: torch.Tensor,
    *,
    fused: bool = True,
    backend: str | None = None,
    group_list_type: GroupListType = "count",
    validate: bool = True,
) -> torch.Tensor:
    """SwiGLU expert MLP over rows grouped by expert.

    Args:
        x_RH: ``[R, H]`` rows grouped by expert (e.g. ``permute``'s output).
        group_list_E: rows per expert (``"count"``) or inclusive row ends (``"cumsum"``), length E.
        gate_up_EH2I: ``[E, H, 2I]``, columns ``[:I]`` the gate, ``[I:]`` the up projection
            (see :mod:`moe_gmm.ops.swiglu`); any strides.
        down_EIH: ``[E, I, H]``; any strides.
        fused: ``False`` runs both matmuls on the eager per-expert loop (the reference).
        backend: force a grouped-matmul backend (see :func:`~moe_gmm.grouped_matmul`).
        validate: check ``group_list`` values (a host sync on an accelerator); a caller whose
            counts come from ``permute`` may pass ``False``.

    Returns:
        ``[R, H]`` in ``x_RH``'s dtype.
    """
    for name, w, dims in (("gate_up_EH2I", gate_up_EH2I, "[E, H, 2I]"), ("down_EIH", down_EIH, "[E, I, H]")):
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(w).__name__}")
        if w.dim() != 3:
            raise ValueError(f"{name} must be 3-D {dims}, got shape {tuple(w.shape)}")
    num_experts, hidden, two_inter = gate_up_EH2I.shape
    if two_inter % 2 != 0:
        raise ValueError(f"gate_up_EH2I.shape[2] must be even (2I), got shape {tuple(gate_up_EH2I.shape)}")
    expected_down = (num_experts, two_inter // 2, hidden)
    if tuple(down_EIH.shape) != expected_down:
        raise ValueError(
            f"down_EIH must have shape [E, I, H] = {expected_down} to match gate_up_EH2I {tuple(gate_up_EH2I.shape)}, "
            f"got {tuple(down_EIH.shape)}"
        )
    gmm = {"fused": fused, "backend": backend, "group_list_type": group_list_type}
    with record_function("moe::gmm"):
        h_R2I = grouped_matmul(x_RH, gate_up_EH2I, group_list_E, validate=validate, **gmm)
    with record_function("moe::swiglu"):
        a_RI = swiglu(h_R2I)
    with record_function("moe::gmm"):
        # group_list was checked by the first call; the second sees the same rows.
        return grouped_matmul(a_RI, down_EIH, group_list_E, validate=False, **gmm)
