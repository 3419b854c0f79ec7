"""``moe-gmm train``'s own files (``init.pt``, ``ckpt_<path>.pt``): saved with a checksum per tensor, verified on load.

A file is a ``torch.save`` dict plus ``"checksums"``: the sha256 of every tensor in it, keyed by the
tensor's place (``model/lm_head.weight``, ``optimizer/state/3/exp_avg``). Loading refuses, with a
:class:`~moe_gmm.checksum.CheckpointError` naming the file and the tensor, a file that cannot be
read, lacks a part, has a tensor without its checksum or whose bytes changed, or (checked against
the model before anything is copied) a tensor missing, unexpected, or of another shape or dtype.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from moe_gmm.checksum import CheckpointError, tensor_digest

__all__ = ["check_state", "load_checked", "save_checked"]

CHECKSUMS = "checksums"


def _tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _tensors(value, f"{prefix}/{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _tensors(value, f"{prefix}/{i}" if prefix else str(i))


def save_checked(path: Path, payload: dict[str, Any]) -> None:
    """``torch.save`` ``payload`` with the checksum of every tensor in it; never leaves a half-written file."""
    checksums = {name: tensor_digest(t) for name, t in _tensors(payload)}
    tmp = path.with_name(path.name + ".tmp")
    torch.save({**payload, CHECKSUMS: checksums}, tmp)
    os.replace(tmp, path)


def load_checked(path: Path, required: tuple[str, ...]) -> dict[str, Any]:
    """The payload saved by :func:`save_checked`, with the ``required`` parts, every checksum verified."""
    where = f"checkpoint {str(path)!r}"
    if not path.is_file():
        raise CheckpointError(f"{where}: no such file")
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - zip, pickle and storage errors all mean "not a checkpoint"
        raise CheckpointError(f"{where}: cannot be read ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{where}: expected a dict, got {type(state).__name__}")
    missing = [key for key in (*required, CHECKSUMS) if key not in state]
    if missing:
        raise CheckpointError(f"{where}: no {missing} (written by another program, or damaged)")
    checksums = state.pop(CHECKSUMS)
    if not isinstance(checksums, dict):
        raise CheckpointError(f"{where}: {CHECKSUMS} is a {type(checksums).__name__}, not a dict")
    seen = set()
    for name, tensor in _tensors(state):
        seen.add(name)
        if name not in checksums:
            raise CheckpointError(f"{where}: tensor {name!r} has no checksum")
        if tensor_digest(tensor) != checksums[name]:
            raise CheckpointError(f"{where}: tensor {name!r} does not match its checksum (the data changed)")
    lost = sorted(set(checksums) - seen)
    if lost:
        raise CheckpointError(f"{where}: tensor {lost[0]!r} is missing ({len(lost)} missing in all)")
    return state


def check_state(state: Any, own: Mapping[str, torch.Tensor], path: Path) -> None:
    """Refuse a model state whose tensors are not exactly ``own``'s (names, shapes, dtypes).

    ``own`` is the model's ``state_dict()``, or meta tensors of its shapes and dtypes.
    """
    where = f"checkpoint {str(path)!r}"
    if not isinstance(state, Mapping):
        raise CheckpointError(f"{where}: the model state is a {type(state).__name__}, not a dict")
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing:
        raise CheckpointError(f"{where}: tensor {missing[0]!r} of the model is missing ({len(missing)} in all)")
    if unexpected:
        raise CheckpointError(f"{where}: tensor {unexpected[0]!r} is not in the model ({len(unexpected)} in all)")
    for name, target in own.items():
        got = state[name]
        if not isinstance(got, torch.Tensor) or got.shape != target.shape or got.dtype != target.dtype:
            found = f"{tuple(got.shape)} {got.dtype}" if isinstance(got, torch.Tensor) else type(got).__name__
            raise CheckpointError(
                f"{where}: tensor {name!r} is {found}, the model's is {tuple(target.shape)} {target.dtype}"
            )
