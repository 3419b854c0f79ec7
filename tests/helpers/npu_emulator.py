"""A CPU emulator of the documented contract of ``torch_npu.npu_grouped_matmul`` (non-quantised).

This is not torch_npu and proves nothing about Ascend kernels: it implements what the vendor
documentation promises (torch_npu API reference for ``npu_grouped_matmul``; CANN aclnnGroupedMatmul
for the k-axis grouping), so the ``npu`` backend's plumbing (argument choice, layouts, group lists,
output lists, limits) can be tested on machines without an NPU. Where the documentation promises
nothing, the emulator poisons the result (NaN), so code relying on an undocumented behaviour fails.

Contract emulated (``C = A @ B`` per group; ``A`` from ``x``, ``B`` from ``weight``):
- ``x``, ``weight``: lists. A 3-D weight ``[E, K, N]`` holds E groups; 2-D weights one each.
- ``group_type``: -1 no grouping (``x[i] @ w[i]``); 0 group along m (a single ``x`` is split by
  rows); 2 group along k (a single ``x [M, Ksum]`` and a single ``weight [Ksum, N]`` are split
  along k, group i gives ``x[:, k_i] @ w[k_i, :]``).
- ``group_list_type``: 0 inclusive cumulative ends, 1 per-group sizes; ``group_list`` a 1-D int64
  tensor; its total must equal the grouped dim (last value for type 0, sum for type 1).
- ``split_item``: 0/1 return one tensor per group; 2/3 return a list with a single tensor
  (m grouping: rows concatenated ``[M, N]``; k grouping: stacked ``[E, M, N]``).
- limits: at most 1024 groups; type-1 ``group_list`` length must not be 1; fp16/bf16/fp32 with x and
  weight sharing a dtype; every tensor's last dim < 65536; no bias; output in x's dtype.
- a k-group with no rows: the output slice is not specified by the documentation -> NaN here.
"""

from __future__ import annotations

import torch

MAX_GROUPS = 1024
MAX_INNER_DIM = 65536
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class NpuContractError(RuntimeError):
    """What the vendor op would reject (it raises a RuntimeError from the CANN runtime)."""


def _bounds(group_list: torch.Tensor, group_list_type: int, total: int) -> list[int]:
    if not isinstance(group_list, torch.Tensor) or group_list.dim() != 1 or group_list.dtype != torch.int64:
        raise NpuContractError("group_list must be a 1-D int64 tensor")
    values = group_list.tolist()
    if len(values) > MAX_GROUPS:
        raise NpuContractError(f"at most {MAX_GROUPS} groups, got {len(values)}")
    if group_list_type == 1:
        if len(values) == 1:
            raise NpuContractError("group_list_type=1 requires a group_list length other than 1")
        if any(v < 0 for v in values):
            raise NpuContractError("group_list_type=1 sizes must be non-negative")
        ends = torch.tensor(values).cumsum(0).tolist()
    elif group_list_type == 0:
        if any(b < a for a, b in zip([0, *values], values)):
            raise NpuContractError("group_list_type=0 must be non-decreasing")
        ends = values
    else:
        raise NpuContractError(f"group_list_type must be 0 or 1, got {group_list_type}")
    if ends and ends[-1] != total:
        raise NpuContractError(f"group_list covers {ends[-1]} of {total} along the grouped dim")
    return [0, *ends]


def _split_weights(weight: list[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    for w in weight:
        if w.dim() == 3:
            out.extend(w.unbind(0))
        elif w.dim() == 2:
            out.append(w)
        else:
            raise NpuContractError(f"weight tensors must be 2-D or 3-D, got {w.dim()}-D")
    return out


def _check_dtypes_and_dims(x: list[torch.Tensor], weight: list[torch.Tensor]) -> None:
    for t in [*x, *weight]:
        if t.dtype not in _DTYPES:
            raise NpuContractError(f"dtype {t.dtype} is not supported (fp16, bf16, fp32)")
        if t.dtype != x[0].dtype:
            raise NpuContractError("x and weight must share a dtype")
        if t.shape[-1] >= MAX_INNER_DIM:
            raise NpuContractError(f"inner dim must be < {MAX_INNER_DIM}, got {t.shape[-1]}")


def _mm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 accumulation, output in the input dtype (as the documented non-quantised path)."""
    return (a.float() @ b.float()).to(dtype)


def npu_grouped_matmul(
    x: list[torch.Tensor],
    weight: list[torch.Tensor],
    *,
    bias: list[torch.Tensor] | None = None,
    group_list: torch.Tensor | None = None,
    split_item: int = 0,
    group_type: int = -1,
    group_list_type: int = 0,
    **unsupported,
) -> list[torch.Tensor]:
    """Emulated ``torch_npu.npu_grouped_matmul`` (see the module docstring for the contract)."""
    if unsupported:
        raise NpuContractError(f"the emulator covers the non-quantised path only; got {sorted(unsupported)}")
    if bias:
        raise NpuContractError("the emulator does not model bias")
    if split_item not in (0, 1, 2, 3):
        raise NpuContractError(f"split_item must be 0..3, got {split_item}")
    if not isinstance(x, (list, tuple)) or not isinstance(weight, (list, tuple)):
        raise NpuContractError("x and weight must be lists of tensors")
    _check_dtypes_and_dims(list(x), list(weight))
    dtype = x[0].dtype
    single_out = split_item in (2, 3)

    if group_type in (-1, 0):
        ws = _split_weights(list(weight))
        if len(ws) > MAX_GROUPS:
            raise NpuContractError(f"at most {MAX_GROUPS} groups, got {len(ws)}")
        if group_type == 0 and len(x) == 1:
            if group_list is None:
                raise NpuContractError("group_type=0 with a single x needs group_list")
            if x[0].dim() != 2:
                raise NpuContractError("a single grouped x must be 2-D")
            bounds = _bounds(group_list, group_list_type, x[0].shape[0])
            if len(bounds) - 1 != len(ws):
                raise NpuContractError(f"group_list has {len(bounds) - 1} groups but weight has {len(ws)}")
            xs = [x[0][s:t] for s, t in zip(bounds[:-1], bounds[1:])]
        else:
            if group_list is not None and group_type == -1:
                raise NpuContractError("group_type=-1 takes no group_list")
            xs = list(x)
            if len(xs) != len(ws):
                raise NpuContractError(f"{len(xs)} x tensors for {len(ws)} weight groups")
        for a, b in zip(xs, ws):
            if a.shape[-1] != b.shape[0]:
                raise NpuContractError(f"k mismatch: x {tuple(a.shape)} vs weight {tuple(b.shape)}")
        ys = [_mm(a, b, dtype) for a, b in zip(xs, ws)]
        return [torch.cat(ys, 0)] if single_out else ys

    if group_type == 2:
        if len(x) != 1 or len(weight) != 1 or x[0].dim() != 2 or weight[0].dim() != 2:
            raise NpuContractError("group_type=2 takes one 2-D x [M, Ksum] and one 2-D weight [Ksum, N]")
        a, b = x[0], weight[0]
        if a.shape[1] != b.shape[0]:
            raise NpuContractError(f"k mismatch: x {tuple(a.shape)} vs weight {tuple(b.shape)}")
        if group_list is None:
            raise NpuContractError("group_type=2 needs group_list")
        bounds = _bounds(group_list, group_list_type, a.shape[1])
        ys = []
        for s, t in zip(bounds[:-1], bounds[1:]):
            if t > s:
                ys.append(_mm(a[:, s:t], b[s:t], dtype))
            else:  # undocumented: poison, so callers must zero it themselves
                ys.append(torch.full((a.shape[0], b.shape[1]), float("nan"), dtype=dtype))
        return [torch.stack(ys, 0)] if single_out else ys

    raise NpuContractError(f"group_type must be -1, 0 or 2, got {group_type}")


# ---------------------------------------------------------------------------------------------
# Token permute / unpermute and SwiGLU (torch_npu API reference; non-padded mode)
# ---------------------------------------------------------------------------------------------

MAX_TOP_K = 512
MAX_EXPERT_ID = 2**24 - 1


def npu_moe_token_permute(tokens: torch.Tensor, indices: torch.Tensor, num_out_tokens: int | None = None):
    """``(permuted [min(T*k, num_out_tokens), H], sorted_indices [T*k] int32)``.

    Stable argsort of the flat (token, slot) ids; ``sorted_indices`` is its inverse, so
    ``permuted[sorted_indices[i]] = tokens[i // k]``.
    """
    if tokens.dtype not in _DTYPES:
        raise NpuContractError(f"tokens dtype {tokens.dtype} is not supported")
    if indices.dtype not in (torch.int32, torch.int64):
        raise NpuContractError("indices must be int32 or int64")
    top_k = 1 if indices.dim() == 1 else indices.shape[1]
    if top_k > MAX_TOP_K:
        raise NpuContractError(f"topK must be <= {MAX_TOP_K}, got {top_k}")
    flat = indices.reshape(-1).to(torch.int64)
    if flat.numel() and int(flat.max()) >= MAX_EXPERT_ID:
        raise NpuContractError(f"expert ids must be < {MAX_EXPERT_ID}")
    order = torch.sort(flat, stable=True).indices
    sorted_indices = torch.empty_like(order)
    sorted_indices[order] = torch.arange(order.numel())
    permuted = tokens[order // top_k]
    if num_out_tokens:
        permuted = permuted[:num_out_tokens]
    return permuted, sorted_indices.to(torch.int32)


def npu_moe_token_unpermute(
    permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor, probs: torch.Tensor | None = None,
    padded_mode: bool = False, restore_shape=None,
) -> torch.Tensor:  # fmt: skip
    """``out[t] = sum_j permuted[sorted_indices[t*k + j]] * probs[t, j]`` (k = 1 without probs)."""
    if padded_mode or restore_shape is not None:
        raise NpuContractError("padded mode is not supported")
    if sorted_indices.dtype != torch.int32:
        raise NpuContractError("sorted_indices must be int32")
    if probs is not None and probs.dtype != permuted_tokens.dtype:
        raise NpuContractError("probs and permuted_tokens must share a dtype")
    top_k = 1 if probs is None else probs.shape[1]
    gathered = permuted_tokens.float()[sorted_indices.long()].view(-1, top_k, permuted_tokens.shape[1])
    weights = torch.ones(gathered.shape[:2]) if probs is None else probs.float()
    return (gathered * weights.unsqueeze(-1)).sum(1).to(permuted_tokens.dtype)


def npu_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``silu(A) * B`` with ``A, B = x.chunk(2, dim)`` (A the first half)."""
    a, b = x.float().chunk(2, dim=dim)
    return (torch.nn.functional.silu(a) * b).to(x.dtype)
