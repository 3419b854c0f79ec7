"""The ``triton`` backend: grouped GEMM kernels for CUDA GPUs, testable on CPU.

Legend: M rows grouped by expert, K input features, N output features, E experts.

- forward: ``y = gmm(x, w)`` over (expert, row tile, column tile) work items that the kernel finds
  on the device from the group ends (no host sync); fp32 accumulation; masked K and N tails.
- grad_input: the same kernel on ``w.transpose(1, 2)`` (a view: strides are passed, nothing is copied).
- grad_weight: a kernel over (expert, K tile, N tile) that reduces over the expert's rows; an
  expert without rows writes zeros.

Triton is imported, and the kernels defined, on the first call (``_kernels()``), so the
interpreter (``TRITON_INTERPRET=1``, CPU tensors) can be switched on by a test before that; the
variable must be set before triton itself is first imported (it fixes the standard library then).
Under the interpreter, bf16 operands are upcast to fp32 before ``tl.dot`` because the interpreter's
bf16 dot is wrong upstream; compiled GPU kernels keep native bf16.

float32 inputs use IEEE fp32 dot products unless ``torch.backends.cuda.matmul.allow_tf32`` is on,
mirroring what ``torch.mm`` does on the same machine.

The launchers (``launch_gmm``, ``launch_gmm_wgrad``) also take the index and scale operands of the
gather/scatter variant used by ``moe_gmm.ops.gather_gmm``.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
from dataclasses import dataclass
from types import ModuleType

import torch

from moe_gmm.ops.backends.base import GmmBackend

_kernels_module: ModuleType | None = None
_kernels_interpreted: bool | None = None  # TRITON_INTERPRET as it was when the kernels were defined
MAX_EXPERTS = 4096  # every program holds the E group ends in registers


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET=1``: kernels run in Triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _kernels() -> ModuleType:
    global _kernels_module, _kernels_interpreted
    if _kernels_module is None:
        _kernels_interpreted = interpreting()
        if _kernels_interpreted:
            _check_interpreter_import_order()
        from moe_gmm.ops.backends import triton_kernels

        _kernels_module = triton_kernels
    return _kernels_module


def _check_interpreter_import_order() -> None:
    """Triton defines its standard library (``tl.zeros``, ``tl.sum``...) when it is imported; only
    if ``TRITON_INTERPRET=1`` was set by then can interpreted kernels call it."""
    standard = sys.modules.get("triton.language.standard")
    if standard is not None and type(standard.zeros).__name__ != "InterpretedFunction":
        raise RuntimeError(
            "TRITON_INTERPRET=1 was set after triton was imported; set it before the first `import triton`"
        )


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes of both kernels. ``block_m`` tiles rows (the wgrad reduction), ``block_k`` the
    forward reduction (and the wgrad output rows)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


def default_config(dtype: torch.dtype, device: torch.device) -> TileConfig:
    """Untuned forward / grad_input tiles: 128x128 outputs on GPUs (a common Hopper/Ampere choice,
    about 96 KiB of shared memory over 3 stages), 64 in the interpreter, where each program costs
    milliseconds and bigger tiles mean fewer programs."""
    if device.type != "cuda":
        return TileConfig(block_m=64, block_n=64, block_k=64)
    if dtype == torch.float32:
        return TileConfig(block_m=128, block_n=128, block_k=32, num_warps=8, num_stages=3)
    return TileConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)


def default_wgrad_config(dtype: torch.dtype, device: torch.device) -> TileConfig:
    """Untuned grad_weight tiles: ``block_k x block_n`` outputs, ``block_m`` rows reduced per step.
    Kept within about 96 KiB of shared memory over 3 stages (fp32 operands are twice as wide)."""
    if device.type != "cuda":
        return TileConfig(block_m=64, block_n=64, block_k=64)
    if dtype == torch.float32:
        return TileConfig(block_m=32, block_n=128, block_k=64, num_warps=8, num_stages=3)
    return TileConfig(block_m=64, block_n=128, block_k=128, num_warps=8, num_stages=3)


def _fit(block: int, dim: int) -> int:
    """Shrink a tile to the problem (power of two, at least 16 for tl.dot)."""
    return max(16, min(block, _next_pow2(dim)))


def _warps(cfg: TileConfig, rows: int, cols: int) -> int:
    """The configured warps for full-size tiles; 4 for tiles shrunk to a small problem (fewer MMA
    tiles than warps otherwise)."""
    return cfg.num_warps if rows * cols >= 64 * 128 else min(cfg.num_warps, 4)


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def _upcast(dtype: torch.dtype) -> bool:
    """bf16 operands go through tl.dot as fp32 only in the interpreter (its bf16 dot is wrong)."""
    return bool(_kernels_interpreted) and dtype == torch.bfloat16


def launch_gmm(
    x: torch.Tensor,
    w_EKN: torch.Tensor,
    group_ends_E: torch.Tensor,
    out: torch.Tensor,
    *,
    x_rows: torch.Tensor | None = None,
    out_rows: torch.Tensor | None = None,
    row_scale: torch.Tensor | None = None,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """Write ``out[out_rows[r]] = row_scale[r] * x[x_rows[r]] @ w[e(r)]`` for every grouped row r.

    Args:
        x: ``[*, K]`` any strides; ``[M, K]`` unless ``x_rows`` gathers rows from it.
        w_EKN: ``[E, K, N]`` any strides.
        group_ends_E: int64 inclusive row ends on the device; the last one is M.
        out: ``[*, N]``; ``[M, N]`` unless ``out_rows`` scatters into it. Rows not named are untouched.
        x_rows / out_rows: optional ``[M]`` integer indices (gather / scatter).
        row_scale: optional ``[M]`` multiplier of each grouped row's result (fp32 math).
    """
    num_experts, k, n = w_EKN.shape
    m = x.shape[0] if x_rows is None else x_rows.shape[0]
    if m == 0 or n == 0:
        return out
    if k == 0:  # nothing to reduce: the product is zero
        rows = slice(None) if out_rows is None else out_rows
        out[rows] = 0
        return out
    cfg = config or default_config(x.dtype, x.device)
    block_m, block_n, block_k = _fit(cfg.block_m, m), _fit(cfg.block_n, n), _fit(cfg.block_k, k)
    max_row_tiles = _cdiv(m, block_m) + num_experts
    grid = (max_row_tiles * _cdiv(n, block_n),)
    dummy = group_ends_E
    _kernels().gmm_kernel[grid](
        x, w_EKN, out, group_ends_E,
        dummy if x_rows is None else x_rows,
        dummy if out_rows is None else out_rows,
        dummy if row_scale is None else row_scale,
        num_experts, max_row_tiles, n, k,
        x.stride(0), x.stride(1), w_EKN.stride(0), w_EKN.stride(1), w_EKN.stride(2), out.stride(0), out.stride(1),
        E_POW2=max(32, _next_pow2(num_experts)), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        GROUP_M=cfg.group_m, GATHER_X=x_rows is not None, SCATTER_Y=out_rows is not None,
        SCALE_Y=row_scale is not None, UPCAST=_upcast(x.dtype), INPUT_PRECISION=_precision(x.dtype),
        num_warps=_warps(cfg, block_m, block_n), num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


def launch_gmm_wgrad(
    x: torch.Tensor,
    dy: torch.Tensor,
    group_ends_E: torch.Tensor,
    *,
    x_rows: torch.Tensor | None = None,
    dy_rows: torch.Tensor | None = None,
    dy_scale: torch.Tensor | None = None,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """``dw[e] = sum_{r in e} x[x_rows[r]]^T (dy_scale[r] * dy[dy_rows[r]])`` as a fresh ``[E, K, N]``."""
    num_experts = group_ends_E.shape[0]
    k, n = x.shape[1], dy.shape[1]
    dw_EKN = x.new_empty(num_experts, k, n)
    if k == 0 or n == 0:
        return dw_EKN
    m = x.shape[0] if x_rows is None else x_rows.shape[0]
    cfg = config or default_wgrad_config(x.dtype, x.device)
    block_m, block_n, block_k = _fit(cfg.block_m, max(m, 1)), _fit(cfg.block_n, n), _fit(cfg.block_k, k)
    grid = (_cdiv(k, block_k) * _cdiv(n, block_n), num_experts)
    dummy = group_ends_E
    _kernels().gmm_wgrad_kernel[grid](
        x, dy, dw_EKN, group_ends_E,
        dummy if x_rows is None else x_rows,
        dummy if dy_rows is None else dy_rows,
        dummy if dy_scale is None else dy_scale,
        k, n,
        x.stride(0), x.stride(1), dy.stride(0), dy.stride(1), dw_EKN.stride(0), dw_EKN.stride(1), dw_EKN.stride(2),
        BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_N=block_n,
        GATHER_X=x_rows is not None, GATHER_DY=dy_rows is not None, SCALE_DY=dy_scale is not None,
        UPCAST=_upcast(x.dtype), INPUT_PRECISION=_precision(x.dtype),
        num_warps=_warps(cfg, block_k, block_n), num_stages=cfg.num_stages,
    )  # fmt: skip
    return dw_EKN


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------------------------------
# The backend interface
# ------------------------------------------------------------------------------------------


def forward(x_MK: torch.Tensor, w_EKN: torch.Tensor, group_ends_E: torch.Tensor) -> torch.Tensor:
    y_MN = x_MK.new_empty(x_MK.shape[0], w_EKN.shape[2])
    return launch_gmm(x_MK, w_EKN, group_ends_E, y_MN)


def grad_input(dy_MN: torch.Tensor, w_EKN: torch.Tensor, group_ends_E: torch.Tensor) -> torch.Tensor:
    dx_MK = dy_MN.new_empty(dy_MN.shape[0], w_EKN.shape[1])
    return launch_gmm(dy_MN, w_EKN.transpose(1, 2), group_ends_E, dx_MK)


def grad_weight(x_MK: torch.Tensor, dy_MN: torch.Tensor, group_ends_E: torch.Tensor) -> torch.Tensor:
    return launch_gmm_wgrad(x_MK, dy_MN, group_ends_E)


@functools.lru_cache(maxsize=None)
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _unavailable_reason() -> str | None:
    if not _triton_installed():
        return "the triton package is not installed (pip install 'moe-gmm[triton]')"
    if not interpreting() and not torch.cuda.is_available():
        return "no CUDA device (set TRITON_INTERPRET=1 before first use to run the kernels on CPU)"
    return None


def _input_refusal(x_MK: torch.Tensor, w_EKN: torch.Tensor) -> str | None:
    if w_EKN.shape[0] > MAX_EXPERTS:
        return f"the triton kernels take at most {MAX_EXPERTS} experts, got {w_EKN.shape[0]}"
    if x_MK.device.type == "cpu" and _kernels_interpreted is False:
        return "kernels were defined without TRITON_INTERPRET=1, so they cannot run on CPU tensors"
    return None


# CPU only under the interpreter, which is read once, when this module is first imported.
_DEVICES = frozenset({"cuda", "cpu"}) if interpreting() else frozenset({"cuda"})

BACKEND = GmmBackend(
    name="triton",
    devices=_DEVICES,
    dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16}),
    forward=forward,
    grad_input=grad_input,
    grad_weight=grad_weight,
    unavailable_reason=_unavailable_reason,
    input_refusal=_input_refusal,
    notes="Triton grouped GEMM; device-side work items, fp32 accumulation; untuned tiles",
)
