"""Routed experts as two 3-D weights run through the grouped matmul.

Legend: T tokens, k experts per token, H hidden, I expert intermediate size, E experts, R = T * k.
"""

from __future__ import annotations

import torch
from torch import nn

from moe_gmm.ops.eager_path import label
from moe_gmm.ops.expert_mlp import routed_experts
from moe_gmm.ops.gather_gmm import moe_mlp_gather_scatter

__all__ = ["GroupedExperts"]


class GroupedExperts(nn.Module):
    """SwiGLU experts: ``permute -> GMM(gate_up_proj) -> swiglu -> GMM(down_proj) -> unpermute``.

    Parameters: ``gate_up_proj [E, H, 2I]`` (columns ``[:I]`` gate, ``[I:]`` up) and
    ``down_proj [E, I, H]``. ``use_grouped_expert_matmul=False`` runs the same math on the eager
    per-expert loop (the numerical reference), to localise a fault in a fused backend.

    ``forward(hidden_TH, top_k_index_Tk, top_k_weights_Tk)`` has the call signature of Hugging
    Face's experts modules; after each call ``last_tokens_per_expert`` holds the detached ``[E]``
    row counts (the grouped matmul's ``group_list``) for load statistics.

    ``validate_routing`` checks that every id lies in ``[0, E)`` (a host sync on an accelerator);
    :class:`~moe_gmm.layers.SparseMoeBlock` turns it off because its router's top-k guarantees it.

    ``fused_permute=True`` runs :func:`~moe_gmm.ops.gather_gmm.moe_mlp_gather_scatter` instead: the
    permute gather and the unpermute scatter happen inside the triton grouped-matmul kernels, so the
    ``[T*k, H]`` permuted activations are never materialised (CUDA, or CPU under the Triton
    interpreter).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        use_grouped_expert_matmul: bool = True,
        backend: str | None = None,
        validate_routing: bool = True,
        fused_permute: bool = False,
    ) -> None:
        super().__init__()
        if fused_permute and (not use_grouped_expert_matmul or backend not in (None, "triton")):
            raise ValueError(
                "fused_permute=True runs the triton gather/scatter kernels; it conflicts with "
                f"use_grouped_expert_matmul={use_grouped_expert_matmul}, backend={backend!r}"
            )
        for name, value in (
            ("num_experts", num_experts),
            ("hidden_size", hidden_size),
            ("intermediate_size", intermediate_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.use_grouped_expert_matmul = use_grouped_expert_matmul
        self.backend = backend
        self.validate_routing = validate_routing
        self.fused_permute = fused_permute
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * intermediate_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.last_tokens_per_expert: torch.Tensor | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's default bound 1/sqrt(fan_in) per expert.
        nn.init.uniform_(self.gate_up_proj, -(self.hidden_size**-0.5), self.hidden_size**-0.5)
        nn.init.uniform_(self.down_proj, -(self.intermediate_size**-0.5), self.intermediate_size**-0.5)

    def forward(
        self, hidden_TH: torch.Tensor, top_k_index_Tk: torch.Tensor, top_k_weights_Tk: torch.Tensor
    ) -> torch.Tensor:
        """``out[t] = sum_j w[t, j] * expert_{idx[t, j]}(hidden[t])``; ``[T, H]`` in hidden's dtype."""
        if hidden_TH.dim() != 2 or hidden_TH.shape[1] != self.hidden_size:
            raise ValueError(f"hidden_TH must have shape [T, {self.hidden_size}], got {tuple(hidden_TH.shape)}")
        if hidden_TH.dtype != self.gate_up_proj.dtype:
            raise TypeError(
                f"hidden_TH dtype {hidden_TH.dtype} must match the expert weights' dtype {self.gate_up_proj.dtype}"
            )
        if top_k_weights_Tk.shape != top_k_index_Tk.shape:
            raise ValueError(
                f"top_k_weights_Tk shape {tuple(top_k_weights_Tk.shape)} must equal top_k_index_Tk shape "
                f"{tuple(top_k_index_Tk.shape)}"
            )
        if self.fused_permute:
            with label("moe::gather_scatter_mlp"):
                out_TH = moe_mlp_gather_scatter(
                    hidden_TH, top_k_index_Tk, top_k_weights_Tk, self.gate_up_proj, self.down_proj,
                    validate=self.validate_routing,
                )  # fmt: skip
            self.last_tokens_per_expert = torch.bincount(top_k_index_Tk.reshape(-1), minlength=self.num_experts)
            return out_TH
        out_TH, tokens_per_expert_E = routed_experts(
            hidden_TH, top_k_index_Tk, top_k_weights_Tk, self.gate_up_proj, self.down_proj,
            fused=self.use_grouped_expert_matmul, backend=self.backend if self.use_grouped_expert_matmul else None,
            validate_routing=self.validate_routing,
        )  # fmt: skip
        self.last_tokens_per_expert = tokens_per_expert_E.detach()
        return out_TH

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}, use_grouped_expert_matmul={self.use_grouped_expert_matmul}, "
            f"backend={self.backend!r}"
            + (", fused_permute=True" if self.fused_permute else "")
        )
