"""Grouped matmul tuned for CPUs: the ``cpu`` backend.

Each pass takes the first of these that applies (``docs/cpu_kernels.md`` has the table and the
measurements behind it):

1. the native bfloat16 kernels (AMX, else AVX-512 BF16) or, for float32, the AVX-512 kernels, for
   experts up to their row limits, the larger experts one library GEMM each on a thread
   (:mod:`.kernels`);
2. one library GEMM per expert, whole experts shared between the threads, in one native call;
3. without the native ops (no compiler, ``MOE_GMM_NATIVE=0``) or for float32 with few experts, the
   torch-only strategies chosen from the group sizes (:mod:`.planning`): a padded ``bmm`` over runs
   of experts (:mod:`.padded`) or a GEMM loop.

Every output comes from :mod:`moe_gmm.ops.host_cache`: a fresh output of tens of MiB is
page-faulted in and zeroed on first touch, a cost of the order of the product itself. The
thresholds are one :class:`CpuTuning` value (:mod:`.tuning`); :func:`use_tuning` changes them.
"""

from __future__ import annotations

import torch

from moe_gmm.ops.backends import eager
from moe_gmm.ops.backends.base import GmmBackend, host_bounds
from moe_gmm.ops.backends.cpu.kernels import (
    amx_available,
    bf16_product,
    experts_product,
    few_rows_product,
    native_grad_weight,
)
from moe_gmm.ops.backends.cpu.padded import pad_reduction, padded_grad_weight, padded_product, release_workspace
from moe_gmm.ops.backends.cpu.planning import GmmPlan, loop_for, plan
from moe_gmm.ops.backends.cpu.tuning import DEFAULT_TUNING, CpuTuning, current_tuning, use_tuning

__all__ = [
    "BACKEND",
    "DEFAULT_TUNING",
    "CpuTuning",
    "GmmPlan",
    "amx_available",
    "current_tuning",
    "forward",
    "grad_input",
    "grad_weight",
    "plan",
    "release_workspace",
    "use_tuning",
]


def forward(x_MK: torch.Tensor, w_EKN: torch.Tensor, group_ends_E: torch.Tensor) -> torch.Tensor:
    out = bf16_product(x_MK, w_EKN, group_ends_E, transpose_w=False)
    if out is None:
        out = few_rows_product(x_MK, w_EKN, group_ends_E)
    if out is None:
        out = experts_product(x_MK, w_EKN, group_ends_E)
    if out is not None:
        return out
    p = plan(host_bounds(group_ends_E), x_MK.dtype)
    x_MK, w_EKN = pad_reduction(x_MK, w_EKN)  # torch's 16-bit GEMMs read past an unaligned K
    if p.strategy == "padded":
        return padded_product(x_MK, w_EKN, p)
    return loop_for(w_EKN, x_MK.shape[0], w_EKN.shape[2]).forward(x_MK, w_EKN, group_ends_E)


def grad_input(dy_MN: torch.Tensor, w_EKN: torch.Tensor, group_ends_E: torch.Tensor) -> torch.Tensor:
    out = bf16_product(dy_MN, w_EKN, group_ends_E, transpose_w=True)
    if out is None:
        out = few_rows_product(dy_MN, w_EKN.transpose(1, 2), group_ends_E)
    if out is None:
        out = experts_product(dy_MN, w_EKN.transpose(1, 2), group_ends_E)
    if out is not None:
        return out
    p = plan(host_bounds(group_ends_E), dy_MN.dtype)
    dy_MN, w_ENK = pad_reduction(dy_MN, w_EKN.transpose(1, 2))  # as in forward, N is reduced here
    if p.strategy == "padded":
        return padded_product(dy_MN, w_ENK, p)
    return loop_for(w_EKN, dy_MN.shape[0], w_EKN.shape[1]).grad_input(dy_MN, w_ENK.transpose(1, 2), group_ends_E)


def grad_weight(x_MK: torch.Tensor, dy_MN: torch.Tensor, group_ends_E: torch.Tensor) -> torch.Tensor:
    dw_EKN = native_grad_weight(x_MK, dy_MN, group_ends_E)
    if dw_EKN is not None:
        return dw_EKN
    p = plan(host_bounds(group_ends_E), x_MK.dtype)
    if p.strategy == "padded":
        return padded_grad_weight(x_MK, dy_MN, p)
    return eager.grad_weight(x_MK, dy_MN, group_ends_E)


BACKEND = GmmBackend(
    name="cpu",
    devices=frozenset({"cpu"}),
    dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16}),
    forward=forward,
    grad_input=grad_input,
    grad_weight=grad_weight,
    notes="bf16 with AMX or AVX-512 BF16: native kernels; fp32 with AVX-512: native grad_weight and few-row "
    "forward and grad_input; "
    "else small even groups: padded bmm over runs of experts, large or uneven groups: a GEMM loop",
)
