"""The ``npu`` backend: Ascend NPUs through ``torch_npu.npu_grouped_matmul``.

Legend: M rows grouped by expert, K input features, N output features, E experts.

The three calls (the reference system's arguments):
- forward      ``npu_grouped_matmul([x_MK], [w_EKN], split_item=2, group_type=0)`` -> ``[y_MN]``
- grad_input   the same call on ``[dy_MN]`` and the weight viewed as ``[E, N, K]`` (a transposed view)
- grad_weight  ``npu_grouped_matmul([x_MK.t()], [dy_MN], split_item=3, group_type=2)`` -> ``[dw_EKN]``
  (grouping along the reduction axis, here the rows)

``group_list_type``: the contract layer hands backends inclusive row ends, which is the vendor's
``group_list_type=0``, so by default they are passed as they are. ``group_list_type="count"`` passes
per-expert sizes (vendor type 1, what the reference system does) at the cost of one subtraction
kernel and the vendor's rule that a type-1 list may not have length 1 (E == 1 is then refused).

Documented vendor limits are enforced before the call, so ``auto`` falls back and a forced
``backend="npu"`` raises a ``ValueError`` naming the limit: at most 1024 groups; fp16/bf16/fp32; the
last dim of every operand (K and N) below 65536. Whether the vendor kernel writes zeros for a
k-group without rows is undocumented, so grad_weight of empty experts is zeroed here.

``make_npu_backend(ops_module, ...)`` builds the backend over any module exposing torch_npu's
``npu_grouped_matmul`` signature; the registered ``BACKEND`` uses ``torch_npu`` itself, imported
on first use.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from typing import Any, Literal

import torch

from moe_gmm.ops.backends.base import GmmBackend, counts_from_ends

MAX_GROUPS = 1024
MAX_INNER_DIM = 65536  # exclusive bound on an operand's last dim
NPU_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})

_VENDOR_LIST_TYPE = {"cumsum": 0, "count": 1}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def make_npu_backend(
    ops: Any,
    *,
    name: str = "npu",
    devices: frozenset[str] = frozenset({"npu"}),
    group_list_type: Literal["cumsum", "count"] = "cumsum",
    unavailable_reason=lambda: None,
) -> GmmBackend:
    """A grouped-matmul backend calling ``ops.npu_grouped_matmul`` with torch_npu's signature.

    Args:
        ops: ``torch_npu`` or any object with an ``npu_grouped_matmul`` of the same contract
            (looked up at call time, so a lazily imported module works).
        devices: device types the backend declares.
        group_list_type: how group lists are passed: ``"cumsum"`` (vendor type 0, the row ends
            as they are) or ``"count"`` (vendor type 1, sizes; refuses E == 1).
        unavailable_reason: returns why the backend cannot run in this process, or None.
    """
    if group_list_type not in _VENDOR_LIST_TYPE:
        raise ValueError(f"group_list_type must be 'cumsum' or 'count', got {group_list_type!r}")
    vendor_type = _VENDOR_LIST_TYPE[group_list_type]

    def vendor_group_list(group_ends_E: torch.Tensor) -> torch.Tensor:
        ends = group_ends_E.to(torch.int64)
        return ends if vendor_type == 0 else counts_from_ends(ends)

    def m_grouped(a_MK: torch.Tensor, w_EKN: torch.Tensor, group_ends_E: torch.Tensor) -> torch.Tensor:
        m, n = a_MK.shape[0], w_EKN.shape[2]
        if m == 0 or n == 0 or a_MK.shape[1] == 0:
            return a_MK.new_zeros(m, n)
        # The vendor op reads ND (dense) activations; an expanded or sliced one is made dense.
        (y_MN,) = ops.npu_grouped_matmul(
            [a_MK.contiguous()], [w_EKN], bias=None, group_list=vendor_group_list(group_ends_E),
            split_item=2, group_type=0, group_list_type=vendor_type,
        )  # fmt: skip
        return y_MN

    def forward(x_MK: torch.Tensor, w_EKN: torch.Tensor, group_ends_E: torch.Tensor) -> torch.Tensor:
        return m_grouped(x_MK, w_EKN, group_ends_E)

    def grad_input(dy_MN: torch.Tensor, w_EKN: torch.Tensor, group_ends_E: torch.Tensor) -> torch.Tensor:
        return m_grouped(dy_MN, w_EKN.transpose(1, 2), group_ends_E)

    def grad_weight(x_MK: torch.Tensor, dy_MN: torch.Tensor, group_ends_E: torch.Tensor) -> torch.Tensor:
        num_experts, k, n = group_ends_E.shape[0], x_MK.shape[1], dy_MN.shape[1]
        if x_MK.shape[0] == 0 or k == 0 or n == 0:
            return x_MK.new_zeros(num_experts, k, n)
        (dw_EKN,) = ops.npu_grouped_matmul(
            [x_MK.contiguous().t()], [dy_MN.contiguous()], bias=None, group_list=vendor_group_list(group_ends_E),
            split_item=3, group_type=2, group_list_type=vendor_type,
        )  # fmt: skip
        # Undocumented for k-groups without rows: force the contract's exact zeros.
        empty_E = counts_from_ends(group_ends_E) == 0
        return dw_EKN.masked_fill(empty_E[:, None, None], 0)

    def input_refusal(x_MK: torch.Tensor, w_EKN: torch.Tensor) -> str | None:
        num_experts, k, n = w_EKN.shape
        if num_experts > MAX_GROUPS:
            return f"npu_grouped_matmul takes at most {MAX_GROUPS} groups, got E={num_experts}"
        if k >= MAX_INNER_DIM or n >= MAX_INNER_DIM:
            return f"npu_grouped_matmul needs K and N < {MAX_INNER_DIM}, got K={k}, N={n}"
        if vendor_type == 1 and num_experts == 1:
            return "npu_grouped_matmul with group_list_type=1 (counts) rejects a group list of length 1 (E=1)"
        return None

    return GmmBackend(
        name=name,
        devices=devices,
        dtypes=NPU_DTYPES,
        forward=forward,
        grad_input=grad_input,
        grad_weight=grad_weight,
        unavailable_reason=unavailable_reason,
        input_refusal=input_refusal,
        notes=f"npu_grouped_matmul via {getattr(ops, '__name__', type(ops).__name__)}, group_list_type={vendor_type}",
    )


class _LazyTorchNpu:
    """``torch_npu``, imported on first attribute access (importing it patches torch)."""

    __name__ = "torch_npu"

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module("torch_npu"), attr)


@functools.lru_cache(maxsize=None)
def _torch_npu_unavailable() -> str | None:
    if importlib.util.find_spec("torch_npu") is None:
        return "torch_npu is not installed"
    try:
        importlib.import_module("torch_npu")
    except Exception as exc:  # a broken CANN install raises many kinds of errors at import
        return f"torch_npu failed to import: {type(exc).__name__}: {exc}"
    npu = getattr(torch, "npu", None)
    if npu is None or not npu.is_available():
        return "torch_npu imports but no NPU device is available"
    return None


BACKEND = make_npu_backend(_LazyTorchNpu(), unavailable_reason=_torch_npu_unavailable)
