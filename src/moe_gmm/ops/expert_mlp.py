"""The routed experts: ``route -> permute -> GMM -> activation -> GMM -> unpermute``.

Legend: T tokens, k experts per token, R = T * k permuted rows (grouped by expert), H hidden,
I expert intermediate size, E experts.

This is the one routed-experts pipeline. :func:`routed_experts` runs it whole for a layer that
holds all experts (:class:`~moe_gmm.layers.GroupedExperts`, the Hugging Face ``"moe_gmm"`` experts);
the expert-parallel dispatcher permutes and exchanges rows itself and runs the middle,
:func:`expert_mlp`, on its local rows and experts. Per layer, ``group_list`` is normalised once
(:func:`~moe_gmm.ops.grouped_matmul.group_rows`) and one backend is chosen for both matmuls.

The activation is pluggable: the default is the fused SwiGLU op on ``[gate | up]`` halves; a
module's own gate (clamped SwiGLU, other activations, interleaved halves) is any callable on rows.
Weights may be strided views: Hugging Face stores ``gate_up_proj [E, 2I, H]`` / ``down_proj
[E, H, I]`` and passes ``.transpose(1, 2)`` views, which the grouped matmul reads in place.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from moe_gmm.ops.backends import select_backend
from moe_gmm.ops.eager_path import label
from moe_gmm.ops.grouped_matmul import (
    GroupListType,
    GroupRows,
    check_operands,
    group_rows,
    grouped_matmul_rows,
    requested_backend,
)
from moe_gmm.ops.permute import permute, unpermute
from moe_gmm.ops.swiglu import swiglu

__all__ = ["Activation", "expert_mlp", "routed_experts"]

# rows [R, N1] after the first matmul -> rows [R, K2] for the second (row-local: any grouping works)
Activation = Callable[[torch.Tensor], torch.Tensor]


def _check_weight(name: str, w: object, dims: str) -> None:
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(w).__name__}")
    if w.dim() != 3:
        raise ValueError(f"{name} must be 3-D {dims}, got shape {tuple(w.shape)}")


def _check_swiglu_weights(gate_up_EH2I: torch.Tensor, down_EIH: torch.Tensor) -> None:
    """The fused SwiGLU's shapes: ``[E, H, 2I]`` and ``[E, I, H]`` (custom activations set their own)."""
    num_experts, hidden, two_inter = gate_up_EH2I.shape
    if two_inter % 2 != 0:
        raise ValueError(f"gate_up_EH2I.shape[2] must be even (2I), got shape {tuple(gate_up_EH2I.shape)}")
    expected_down = (num_experts, two_inter // 2, hidden)
    if tuple(down_EIH.shape) != expected_down:
        raise ValueError(
            f"down_EIH must have shape [E, I, H] = {expected_down} to match gate_up_EH2I {tuple(gate_up_EH2I.shape)}, "
            f"got {tuple(down_EIH.shape)}"
        )


def _add_expert_bias(h_RN: torch.Tensor, bias_EN: torch.Tensor | None, expert_of_row_R: torch.Tensor | None):
    return h_RN if bias_EN is None else h_RN + bias_EN[expert_of_row_R]


def _expert_of_row(rows: GroupRows, device: torch.device) -> torch.Tensor:
    counts_E = torch.diff(rows.ends, prepend=rows.ends.new_zeros(1))
    return torch.repeat_interleave(torch.arange(rows.num_experts, device=device), counts_E, output_size=rows.num_rows)


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
    activation: Activation | None = None,
    biases: tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
    post: Activation | None = None,
) -> torch.Tensor:
    """The expert MLP over rows grouped by expert: ``GMM -> activation -> GMM``.

    Args:
        x_RH: ``[R, H]`` rows grouped by expert (e.g. ``permute``'s output).
        group_list_E: rows per expert (``"count"``) or inclusive row ends (``"cumsum"``), length E.
        gate_up_EH2I: ``[E, H, 2I]``, columns ``[:I]`` the gate, ``[I:]`` the up projection
            (see :mod:`moe_gmm.ops.swiglu`); any strides. With a custom ``activation``, any
            ``[E, H, N1]`` whose rows it maps to ``down_EIH``'s input width.
        down_EIH: ``[E, I, H]``; any strides.
        fused: ``False`` runs both matmuls on the eager per-expert loop (the reference).
        backend: force a grouped-matmul backend (see :func:`~moe_gmm.grouped_matmul`); one backend
            that accepts both matmuls is chosen.
        validate: check ``group_list`` values (a host sync on an accelerator); a caller whose
            counts come from ``permute`` may pass ``False``.
        activation: the rows' activation between the matmuls; None: the fused SwiGLU op.
        biases: per-expert ``([E, N1] or None, [E, H] or None)`` added after each matmul.
        post: applied to the ``[R, H]`` result (a post-expert norm).

    Returns:
        ``[R, H]`` in ``x_RH``'s dtype.
    """
    _check_weight("gate_up_EH2I", gate_up_EH2I, "[E, H, 2I]")
    _check_weight("down_EIH", down_EIH, "[E, I, H]")
    if activation is None:
        _check_swiglu_weights(gate_up_EH2I, down_EIH)
    check_operands(x_RH, gate_up_EH2I)
    backend = requested_backend(fused, backend)
    rows = group_rows(
        group_list_E, num_experts=gate_up_EH2I.shape[0], num_rows=x_RH.shape[0], device=x_RH.device,
        group_list_type=group_list_type, validate=validate,
    )  # fmt: skip
    # The second matmul's rows do not exist yet: a strided stand-in of their shape asks for it.
    rows_in, width = x_RH.shape[0], down_EIH.shape[1]
    second_x = x_RH[:, :1].expand(rows_in, width) if x_RH.shape[1] else x_RH.new_empty(rows_in, width)
    check_operands(second_x, down_EIH)
    chosen = select_backend(x_RH, gate_up_EH2I, backend, also=((second_x, down_EIH),)).name
    return _run_mlp(x_RH, rows, gate_up_EH2I, down_EIH, chosen, activation, biases, post)


def _run_mlp(x_RH, rows: GroupRows, first_EKN, second_EKN, backend: str, activation, biases, post) -> torch.Tensor:
    """The checked MLP: two matmuls on one :class:`GroupRows` and one backend."""
    first_bias, second_bias = biases if biases is not None else (None, None)
    expert_of_row_R = None
    if first_bias is not None or second_bias is not None:
        expert_of_row_R = _expert_of_row(rows, x_RH.device)
    with label("moe::gmm"):
        h = _add_expert_bias(grouped_matmul_rows(x_RH, first_EKN, rows, backend), first_bias, expert_of_row_R)
    with label("moe::swiglu"):
        h = swiglu(h) if activation is None else activation(h)
    with label("moe::gmm"):
        y = _add_expert_bias(grouped_matmul_rows(h, second_EKN, rows, backend), second_bias, expert_of_row_R)
    return y if post is None else post(y)


def routed_experts(
    hidden_TH: torch.Tensor,
    top_k_index_Tk: torch.Tensor,
    top_k_weights_Tk: torch.Tensor,
    gate_up_EH2I: torch.Tensor,
    down_EIH: torch.Tensor,
    *,
    fused: bool = True,
    backend: str | None = None,
    validate_routing: bool = True,
    activation: Activation | None = None,
    biases: tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
    post: Activation | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``out[t] = sum_j w[t, j] * expert_{idx[t, j]}(hidden[t])`` over all E experts held here.

    ``permute`` (ids checked in ``[0, E)`` when ``validate_routing``) -> :func:`expert_mlp` (its
    keyword arguments) -> ``unpermute`` with permute's own map. Returns ``(out [T, H],
    tokens_per_expert [E])``, the counts for load statistics.
    """
    with label("moe::permute"):
        permuted_RH, row_id_map_R, counts_E = permute(
            hidden_TH, top_k_index_Tk, gate_up_EH2I.shape[0], validate=validate_routing
        )
    out_RH = expert_mlp(
        permuted_RH, counts_E, gate_up_EH2I, down_EIH, fused=fused, backend=backend,
        validate=False,  # bincount output: non-negative and summing to R by construction
        activation=activation, biases=biases, post=post,
    )  # fmt: skip
    with label("moe::unpermute"):
        return unpermute(out_RH, row_id_map_R, top_k_weights_Tk, validate=False), counts_E  # permute's own map
