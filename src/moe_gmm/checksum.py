"""Per-tensor checksums for checkpoints, and the one error type every failed checkpoint load raises.

A checksum is the sha256 of a tensor's bytes in row-major order: it does not depend on the device
or the strides the tensor had, and it catches a flipped bit or an injected NaN that a format's own
parser accepts. It guards against damage, not against someone who rewrites the checksums too.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["CheckpointError", "tensor_digest"]


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded; the message names the file and, where one is to blame, the tensor."""


def tensor_digest(tensor: torch.Tensor) -> str:
    """Hex sha256 of ``tensor``'s bytes (row-major, whatever its strides or device)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy()).hexdigest()
