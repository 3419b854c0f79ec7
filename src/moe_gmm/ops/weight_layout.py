"""Expert weights laid out in storage for the grouped matmul: padded rows, or a transposed storage.

Both keep the values and shape; only the storage changes, and every backend reads a strided
weight in place, so results stay exact.

Padded rows. The grouped matmul's CPU kernels read a few-row expert's weight in column strips, one
line of each row in turn. When rows lie a multiple of 1-4 KiB apart (a contiguous float32
``[E, K, N]`` with N = 512 or 1024), every line of a strip falls in the same few sets of the core's
caches, which then hold a small part of what is read ahead. One cache line of padding per row
spreads them out. float32 few-row experts gained from it, less since the forward kernels read the
weight ahead in address order; bf16 gained nothing (``docs/cpu_kernels.md``). Results are
identical bit for bit.

Transposed storage. Hugging Face experts keep ``[E, out, in]`` weights (``nn.Linear``'s order),
which reach the grouped matmul as ``[E, in, out]`` views with the reduction running along the
storage's rows. :func:`store_transposed` keeps the ``[E, out, in]`` shape over ``[E, in, out]``
storage, so the grouped matmul sees the contiguous ``[E, K, N]`` weight its forward streams best;
the backward's two passes swap kernels. The forward takes a different kernel, so results agree to
rounding rather than bit for bit.
"""

from __future__ import annotations

import torch

__all__ = [
    "ROW_PAD_BYTES",
    "default_row_pad",
    "lay_out_rows",
    "lay_out_transposed",
    "pad_rows",
    "row_padding",
    "store_transposed",
    "stored_transposed",
]

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
    bf16 cases ran slower than contiguous. The storage grows by ``pad`` elements per row.
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


def stored_transposed(weight: torch.Tensor) -> bool:
    """Whether ``weight [..., R, C]`` is the transposed view of a ``[..., C, R]`` storage (padded or not)
    rather than a row-major one; a contiguous weight is not."""
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() < 2 or weight.numel() == 0 or weight.is_contiguous():
        return False
    return weight.mT.is_contiguous() or row_padding(weight.mT) > 0


def store_transposed(weight: torch.Tensor, pad: int = 0) -> torch.Tensor:
    """A copy of ``weight [..., R, C]`` whose storage is ``[..., C, R]`` (rows padded by ``pad``
    elements, zeroed, when ``pad`` > 0), returned as the ``[..., R, C]`` view: same values, dtype and
    device, detached."""
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() < 2:
        raise ValueError(f"weight must have at least 2 dims [..., rows, cols], got shape {tuple(weight.shape)}")
    if isinstance(pad, bool) or not isinstance(pad, int) or pad < 0:
        raise ValueError(f"pad must be an int >= 0, got {pad!r}")
    flipped = weight.detach().mT
    return (pad_rows(flipped, pad) if pad else flipped.contiguous()).mT


def _storage_rows(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``t`` as the view whose rows are its storage's rows, and whether that took a transpose."""
    return (t.mT, True) if stored_transposed(t) else (t, False)


def lay_out_rows(param: torch.Tensor, padded: bool) -> None:
    """Re-lay out ``param`` in place, replacing its ``.data`` (the object, and an optimizer's hold on
    it, stay): padded rows with ``padded`` (on CPU; elsewhere it is left as it is), unpadded without.
    A transposed storage stays transposed, its own rows padded or not. The values do not change."""
    with torch.no_grad():
        rows, flipped = _storage_rows(param.data)
        if padded and param.device.type == "cpu" and row_padding(rows) == 0:
            rows = pad_rows(rows)
        elif not padded and not rows.is_contiguous():
            rows = rows.contiguous()
        else:
            return
        param.data = rows.mT if flipped else rows


def lay_out_transposed(param: torch.Tensor, transposed: bool) -> None:
    """Re-lay out ``param [..., R, C]`` in place, replacing its ``.data``: over ``[..., C, R]`` storage
    with ``transposed`` (:func:`store_transposed`), row-major without. Padded rows stay padded (by
    the default pad). The values do not change."""
    with torch.no_grad():
        if param.dim() < 2 or stored_transposed(param.data) == transposed:
            return
        rows, _ = _storage_rows(param.data)
        padded = row_padding(rows) > 0
        source = param.data.mT if transposed else param.data  # the new storage's rows
        new_rows = pad_rows(source) if padded else source.contiguous()
        param.data = new_rows.mT if transposed else new_rows
