"""Triton kernels of the grouped matmul. Imported only on first use (see ``triton.py``).

Legend: M rows grouped by expert (R when the rows are a permutation of T*k token slots), K the
reduction dim of the forward GEMM, N output columns, E experts.

Importing this module defines the kernels: Triton reads ``TRITON_INTERPRET`` at that moment, so
the variable must be set before the first call into the triton backend.

Work items are found on the device, without a host sync: every program loads the E group ends,
derives the number of ``BLOCK_M`` row tiles of each expert and their running sum, and locates its
own (expert, first row) by counting the tile ends at or below its row-tile index. The grid is
sized from shapes alone: ``cdiv(M, BLOCK_M) + E`` row tiles bound the real count (each expert adds
at most one partial tile); programs past the last real tile return at once.

Optional index paths (the gather/scatter variant of the MoE experts, as in ScatterMoE):
- ``GATHER_X``: row r of the GEMM reads ``x[x_rows[r]]`` (the permute fused into the loads);
- ``SCATTER_Y``: row r is stored at ``y[y_rows[r]]`` (the unpermute scatter in the epilogue);
- ``SCALE_Y`` / ``SCALE_DY``: row r is multiplied by ``scale[r]`` (routing probabilities).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _locate_row_tile(ends_ptr, pid_m, num_experts, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
    """(expert, first row of the tile, end row of the expert) for row tile ``pid_m``.

    ``expert >= num_experts`` means the tile lies past the last real one.
    """
    offs_e = tl.arange(0, E_POW2)
    valid = offs_e < num_experts
    ends = tl.load(ends_ptr + offs_e, mask=valid, other=0)
    starts = tl.load(ends_ptr + offs_e - 1, mask=valid & (offs_e > 0), other=0)
    counts = tl.where(valid, ends - starts, 0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_ends = tl.cumsum(tiles, 0)
    expert = tl.sum((tile_ends <= pid_m).to(tl.int32), 0)
    mine = offs_e == expert
    first_tile = tl.sum(tl.where(mine, tile_ends - tiles, 0), 0)
    row_start = tl.sum(tl.where(mine, starts, 0), 0) + (pid_m - first_tile) * BLOCK_M
    row_end = tl.sum(tl.where(mine, ends, 0), 0)
    return expert, row_start, row_end


@triton.jit
def gmm_kernel(
    x_ptr, w_ptr, y_ptr, ends_ptr, x_rows_ptr, y_rows_ptr, scale_ptr,
    num_experts, max_row_tiles, N, K,
    stride_xm, stride_xk, stride_we, stride_wk, stride_wn, stride_ym, stride_yn,
    E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, GATHER_X: tl.constexpr, SCATTER_Y: tl.constexpr, SCALE_Y: tl.constexpr,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """``y[rows_e] = x[rows_e] @ w[e]`` for one (row tile, column tile) work item, fp32 accumulation."""
    # Grouped launch order: GROUP_M row tiles sweep every column tile before moving on, so their
    # rows of x stay in L2 while the expert's weight columns stream past.
    pid = tl.program_id(0)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    tiles_per_group = GROUP_M * num_n_tiles
    first_m = (pid // tiles_per_group) * GROUP_M
    group_size = tl.minimum(max_row_tiles - first_m, GROUP_M)
    pid_m = first_m + (pid % tiles_per_group) % group_size
    pid_n = (pid % tiles_per_group) // group_size

    expert, row_start, row_end = _locate_row_tile(ends_ptr, pid_m, num_experts, BLOCK_M, E_POW2)
    if expert >= num_experts:
        return
    rows = row_start + tl.arange(0, BLOCK_M)
    row_mask = rows < row_end
    if GATHER_X:
        x_rows = tl.load(x_rows_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    else:
        x_rows = rows.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + x_rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_k[:, None] * stride_wk + cols[None, :] * stride_wn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        if UPCAST:  # the interpreter's bf16 tl.dot is wrong (triton-lang/triton#11584)
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    if SCALE_Y:
        scale = tl.load(scale_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        acc = acc * scale[:, None]
    if SCATTER_Y:
        y_rows = tl.load(y_rows_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    else:
        y_rows = rows.to(tl.int64)
    y_ptrs = y_ptr + y_rows[:, None] * stride_ym + cols[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def gmm_wgrad_kernel(
    x_ptr, dy_ptr, dw_ptr, ends_ptr, x_rows_ptr, dy_rows_ptr, scale_ptr,
    K, N,
    stride_xm, stride_xk, stride_dym, stride_dyn, stride_we, stride_wk, stride_wn,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    GATHER_X: tl.constexpr, GATHER_DY: tl.constexpr, SCALE_DY: tl.constexpr,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """``dw[e][k_tile, n_tile] = x[rows_e, k_tile]^T @ dy[rows_e, n_tile]``; an empty expert writes zeros."""
    pid = tl.program_id(0)
    expert = tl.program_id(1)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    pid_k = pid // num_n_tiles
    pid_n = pid % num_n_tiles
    row_end = tl.load(ends_ptr + expert)
    row_start = tl.load(ends_ptr + tl.maximum(expert - 1, 0))
    row_start = tl.where(expert > 0, row_start, 0)

    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_mask = ks < K
    n_mask = ns < N
    offs_m = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for m0 in range(row_start, row_end, BLOCK_M):
        rows = m0 + offs_m
        row_mask = rows < row_end
        if GATHER_X:
            x_rows = tl.load(x_rows_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        else:
            x_rows = rows.to(tl.int64)
        if GATHER_DY:
            dy_rows = tl.load(dy_rows_ptr + rows, mask=row_mask, other=0).to(tl.int64)
        else:
            dy_rows = rows.to(tl.int64)
        # x tile loaded already transposed: [BLOCK_K, BLOCK_M]
        a = tl.load(
            x_ptr + x_rows[None, :] * stride_xm + ks[:, None] * stride_xk,
            mask=k_mask[:, None] & row_mask[None, :],
            other=0.0,
        )
        b = tl.load(
            dy_ptr + dy_rows[:, None] * stride_dym + ns[None, :] * stride_dyn,
            mask=row_mask[:, None] & n_mask[None, :],
            other=0.0,
        )
        if SCALE_DY:
            scale = tl.load(scale_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
            b = (b.to(tl.float32) * scale[:, None]).to(a.dtype)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)

    dw_ptrs = dw_ptr + expert.to(tl.int64) * stride_we + ks[:, None] * stride_wk + ns[None, :] * stride_wn
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=k_mask[:, None] & n_mask[None, :])
