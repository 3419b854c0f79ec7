"""The reference backend: one matmul per expert, in the input dtype.

It is the numerical truth the fused backends are compared against and the path taken with
``fused=False``; it runs everywhere torch.mm runs, float64 included (for gradcheck).
"""

from __future__ import annotations

import torch

from moe_gmm.ops import host_cache
from moe_gmm.ops.backends.base import GmmBackend, host_bounds


def forward(x_MK: torch.Tensor, w_EKN: torch.Tensor, group_ends_E: torch.Tensor) -> torch.Tensor:
    bounds = host_bounds(group_ends_E)
    y_MN = host_cache.empty((x_MK.shape[0], w_EKN.shape[2]), dtype=x_MK.dtype, device=x_MK.device)
    for expert, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if end > start:
            torch.mm(x_MK[start:end], w_EKN[expert], out=y_MN[start:end])
    return y_MN


def grad_input(dy_MN: torch.Tensor, w_EKN: torch.Tensor, group_ends_E: torch.Tensor) -> torch.Tensor:
    bounds = host_bounds(group_ends_E)
    dx_MK = host_cache.empty((dy_MN.shape[0], w_EKN.shape[1]), dtype=dy_MN.dtype, device=dy_MN.device)
    for expert, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if end > start:
            torch.mm(dy_MN[start:end], w_EKN[expert].t(), out=dx_MK[start:end])
    return dx_MK


def grad_weight(x_MK: torch.Tensor, dy_MN: torch.Tensor, group_ends_E: torch.Tensor) -> torch.Tensor:
    bounds = host_bounds(group_ends_E)
    num_experts = len(bounds) - 1
    dw_EKN = host_cache.empty((num_experts, x_MK.shape[1], dy_MN.shape[1]), dtype=x_MK.dtype, device=x_MK.device)
    for expert, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if end > start:
            torch.mm(x_MK[start:end].t(), dy_MN[start:end], out=dw_EKN[expert])
        else:
            dw_EKN[expert].zero_()
    return dw_EKN


BACKEND = GmmBackend(
    name="eager",
    devices=frozenset({"cpu", "cuda", "npu", "xpu", "mps", "meta"}),
    dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16, torch.float64}),
    forward=forward,
    grad_input=grad_input,
    grad_weight=grad_weight,
    notes="per-expert torch.mm loop; one host sync per call to read the group bounds",
)
