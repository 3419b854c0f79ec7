"""Ascend fused kernels behind ``permute``, ``unpermute`` and ``swiglu`` (forward passes).

Legend: T tokens, k top-k slots, H hidden, E experts, R = T*k rows.

On an ``npu`` tensor, when ``torch_npu`` imports, the custom ops in ``permute.py`` and
``swiglu.py`` run these vendor kernels for their forward; their backward formulas stay the
portable index / elementwise ops (they run on any device). The vendor contracts (torch_npu API
reference) and how they map onto ours:

- ``npu_moe_token_permute(tokens, indices) -> (permuted, sorted_indices)``: stable sort of the flat
  (token, slot) expert ids; ``sorted_indices`` (int32, length T*k) is exactly our ``row_id_map``.
  Limits: top-k <= 512, expert ids < 2**24 - 1 (beyond them the portable path runs).
- ``npu_moe_token_unpermute(permuted, sorted_indices, probs) -> [T, H]``:
  ``out[t] = sum_j permuted[sorted_indices[t*k + j]] * probs[t, j]``; permuted and probs share a dtype.
- ``npu_swiglu(x, dim=-1)``: ``silu(first half) * second half``, our convention.

Every function takes the ops module explicitly (``torch_npu`` itself, or the test suite's emulator
of the vendor contract), so the argument plumbing is tested without an NPU.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Any

import torch

__all__ = ["npu_ops", "permute_forward", "swiglu_forward", "unpermute_forward"]

MAX_TOP_K = 512
MAX_EXPERT_ID = 2**24 - 1  # ids must be below this (vendor limit)


@functools.lru_cache(maxsize=None)
def npu_ops() -> ModuleType | None:
    """``torch_npu`` when it imports, else None (cached; importing it patches torch once)."""
    try:
        return importlib.import_module("torch_npu")
    except Exception:  # not installed, or a broken CANN install
        return None


def vendor_ops_for(t: torch.Tensor) -> ModuleType | None:
    """The vendor module to run ``t``'s op on: torch_npu for an ``npu`` tensor, else None."""
    return npu_ops() if t.device.type == "npu" else None


def permute_fits(selected_experts_Tk: torch.Tensor, num_experts: int) -> bool:
    return selected_experts_Tk.shape[1] <= MAX_TOP_K and num_experts <= MAX_EXPERT_ID


def permute_forward(
    ops: Any, hidden_TH: torch.Tensor, selected_experts_Tk: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(permuted_RH, row_id_map_R int64, tokens_per_expert_E int64)`` from the vendor permute."""
    permuted_RH, sorted_indices_R = ops.npu_moe_token_permute(hidden_TH, selected_experts_Tk.to(torch.int32))
    tokens_per_expert_E = torch.bincount(selected_experts_Tk.reshape(-1).to(torch.int64), minlength=num_experts)
    return permuted_RH, sorted_indices_R.to(torch.int64), tokens_per_expert_E


def unpermute_forward(ops: Any, expert_out_RH: torch.Tensor, row_id_map_R: torch.Tensor, probs_Tk: torch.Tensor):
    """``[T, H]`` in ``expert_out_RH``'s dtype; probs are cast to it first (the vendor wants one dtype)."""
    return ops.npu_moe_token_unpermute(expert_out_RH, row_id_map_R.to(torch.int32), probs_Tk.to(expert_out_RH.dtype))


def swiglu_forward(ops: Any, x: torch.Tensor) -> torch.Tensor:
    return ops.npu_swiglu(x, dim=-1)
