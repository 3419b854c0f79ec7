"""Input checks of permute / unpermute: types, shapes, expert ids and the row map.

Each raises a ``TypeError`` or ``ValueError`` naming the argument. The value checks read data
(a host sync on an accelerator) except :func:`check_row_id_map_in_op`, which the custom op runs
where the map lives so compiled graphs keep it.
"""

from __future__ import annotations

import torch

__all__ = [
    "FLOAT_DTYPES",
    "INDEX_DTYPES",
    "check_expert_ids",
    "check_flag",
    "check_float",
    "check_index",
    "check_row_id_map",
    "check_row_id_map_in_op",
    "dtype_name",
]

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_float(name: str, t: torch.Tensor, dim: int, shape_doc: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must have a floating dtype in {[dtype_name(d) for d in FLOAT_DTYPES]}, got {dtype_name(t.dtype)}"
        )
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D {shape_doc}, got shape {tuple(t.shape)}")


def check_index(name: str, t: torch.Tensor, dim: int, shape_doc: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be an int32 or int64 tensor, got dtype {dtype_name(t.dtype)}")
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D {shape_doc}, got shape {tuple(t.shape)}")


def check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def check_expert_ids(selected_experts_Tk: torch.Tensor, num_experts: int) -> None:
    # Host sync on an accelerator: the id range is data.
    lo, hi = (int(v) for v in torch.aminmax(selected_experts_Tk))
    if lo < 0 or hi >= num_experts:
        bad = lo if lo < 0 else hi
        where = torch.nonzero(selected_experts_Tk == bad)[0].tolist()
        raise ValueError(
            f"selected_experts_Tk ids must lie in [0, num_experts={num_experts}), got {bad} at index {tuple(where)}"
        )


def check_row_id_map(row_id_map_R: torch.Tensor, num_rows: int) -> None:
    """Values in ``[0, R)`` and every row used once: what both ops index memory with."""
    # Host syncs on an accelerator (validate=True asks for them): the map's values are data.
    lo, hi = (int(v) for v in torch.aminmax(row_id_map_R))
    if lo < 0 or hi >= num_rows:
        outside = (row_id_map_R < 0) | (row_id_map_R >= num_rows)
        bad = int(torch.nonzero(outside)[0, 0])
        raise ValueError(
            f"row_id_map_R values must lie in [0, R = {num_rows}) (rows of expert_out_RH), "
            f"got row_id_map_R[{bad}] = {int(row_id_map_R[bad])}"
        )
    seen = torch.zeros(num_rows, dtype=torch.bool, device=row_id_map_R.device)
    seen.index_fill_(0, row_id_map_R, True)
    if not bool(seen.all()):
        unused = int(torch.nonzero(~seen)[0, 0])
        raise ValueError(
            f"row_id_map_R must be a permutation of range({num_rows}) as returned by permute: row {unused} "
            f"is never referenced, so another is referenced twice"
        )


def check_row_id_map_in_op(row_id_map_R: torch.Tensor, num_rows: int) -> None:
    """The permutation check where the map lives, without a host sync on an accelerator.

    CPU: :func:`check_row_id_map` (reading values there costs no sync). CUDA: one asynchronous
    device-side assert that the values lie in ``[0, R)`` and cover every row. Other devices:
    unchecked here (their support of that assert is unknown); the boundary's host check covers
    eager calls there.
    """
    if num_rows == 0:
        return
    if row_id_map_R.device.type == "cpu":
        check_row_id_map(row_id_map_R, num_rows)
    elif row_id_map_R.device.type == "cuda":
        in_range = (row_id_map_R >= 0) & (row_id_map_R < num_rows)
        seen = torch.zeros(num_rows, dtype=torch.bool, device=row_id_map_R.device)
        seen.index_fill_(0, torch.where(in_range, row_id_map_R, 0), True)
        torch._assert_async(
            in_range.all() & seen.all(), "row_id_map_R must be a permutation of range(T*k) as returned by permute"
        )
