"""Expert weights with padded rows: the same values, each row followed by unused elements in storage.

Why: the grouped matmul's CPU kernels read a few-row expert's weight in column strips, one line of
each row in turn. When rows lie a multiple of 1-4 KiB apart (a contiguous float32 ``[E, K, N]``
with N = 512 or 1024), every line of a strip falls in the same few sets of the core's caches, which
then hold a small part of what is read ahead. One cache line of padding per row spreads them out:
on the benchmark machine the forward of 16-row float32 experts (E256, K1024 N512 and K256 N1024)
ran 1.2-1.3x faster on the same values, and an E256 layer's forward 1.21x, fwd+bwd 1.04-1.12x;
bf16 gained nothing (``benchmarks/RESULTS.md``, AMD EPYC item 11, "Padded expert rows"). Every
backend reads a strided weight in place, so only the storage changes; results are identical bit
for bit.
"""

from __future__ import annotations

import torch

__all__ = ["ROW_PAD_BYTES", "default_row_pad", "lay_out_rows", "pad_rows", "row_padding"]

# One cache line: the smallest shift that moves each row's lines to the next cache set.
ROW_PAD_BYTES = 64


def default_row_pad(dtype: torch.dtype) -> int:
    """Elements of padding per row for ``dtype``: :data:`ROW_PAD_BYTES` worth (16 float32, 32 bf16)."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    return max(1, ROW_PAD_BYTES // torch.empty((), dtype=dtype).element_size())


def row_padding(weight: torch.Tensor) -> int:
    """Elements between the end of one row and the start of the next, for a weight whose storage is
    a padded block (``weight`` the ``[..., R, C]`` view of ``[..., R, C + pad]``); 0 otherwise,
    including for any other strided view."""
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() < 2 or weight.numel() == 0 or weight.stride(-1) != 1:
        return 0
    rows, cols = weight.shape[-2], weight.shape[-1]
    pad = weight.stride(-2) - cols
    if pad <= 0:
        return 0
    # every outer dimension must step over whole padded blocks, in order
    expected = weight.stride(-2) * rows
    for size, stride in zip(reversed(weight.shape[:-2]), reversed(weight.stride()[:-2])):
        if size > 1 and stride != expected:
            return 0
        expected *= size
    return pad


def pad_rows(weight: torch.Tensor, pad: int | None = None) -> torch.Tensor:
    """A copy of ``weight [..., R, C]`` whose storage is ``[..., R, C + pad]`` (the padding zeroed),
    returned as the ``[..., R, C]`` view: same values, dtype and device, detached.

    ``pad`` defaults to :func:`default_row_pad`, one cache line, the pad measured best: rows no
    longer 16-byte aligned leave the fused kernels' fastest paths, and with half a line (16 bf16) the
    E256 bf16 cases ran 0.52-0.93x as fast as contiguous. The storage grows by ``pad`` elements per row.
    """
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() < 2:
        raise ValueError(f"weight must have at least 2 dims [..., rows, cols], got shape {tuple(weight.shape)}")
    if pad is None:
        pad = default_row_pad(weight.dtype)
    if isinstance(pad, bool) or not isinstance(pad, int) or pad < 1:
        raise ValueError(f"pad must be a positive int, got {pad!r}")
    storage = torch.zeros(*weight.shape[:-1], weight.shape[-1] + pad, dtype=weight.dtype, device=weight.device)
    padded = storage[..., : weight.shape[-1]]
    padded.copy_(weight.detach())
    return padded


def lay_out_rows(param: torch.Tensor, padded: bool) -> None:
    """Re-lay out ``param`` in place, replacing its ``.data`` (the object, and an optimizer's hold on
    it, stay): padded rows with ``padded`` (on CPU; elsewhere it is left as it is), contiguous
    without. The values do not change."""
    with torch.no_grad():
        if padded and param.device.type == "cpu" and row_padding(param) == 0:
            param.data = pad_rows(param.data)
        elif not padded and not param.is_contiguous():
            param.data = param.data.contiguous()
