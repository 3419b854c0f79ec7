"""Checksums for checkpoints, the signed manifest of a checkpoint directory, and ``CheckpointError``.

A tensor checksum is the sha256 of its bytes in row-major order: it does not depend on the device
or the strides the tensor had, and it catches a flipped bit or an injected NaN that a format's own
parser accepts.

A checkpoint directory is signed by ``manifest.json``, written after every other file is complete:
the sha256 and size of every file, the sha256 of every named byte range (one per tensor chunk or
pickled value, as the format's own index places them) and a sha256 over the manifest itself.
:func:`verify_manifest` checks all of it before anything is read into a model, so one changed byte
anywhere is refused naming the file, and the tensor when the byte lies in a tensor's payload. It
guards against damage, not against someone who rewrites the digests too.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch

__all__ = [
    "MANIFEST",
    "ByteRange",
    "CheckpointError",
    "file_digest",
    "tensor_digest",
    "verify_manifest",
    "write_manifest",
]

MANIFEST = "manifest.json"
_FORMAT = "moe-gmm-manifest/1"
_CHUNK = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded; the message names the file and, where one is to blame, the tensor."""


class ByteRange(NamedTuple):
    """Where one named item (a tensor chunk, a pickled value) lies: ``length`` bytes of ``file`` at ``offset``."""

    file: str
    offset: int
    length: int


def tensor_digest(tensor: torch.Tensor) -> str:
    """Hex sha256 of ``tensor``'s bytes (row-major, whatever its strides or device)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy()).hexdigest()


def file_digest(path: Path, offset: int = 0, length: int | None = None) -> str:
    """Hex sha256 of ``length`` bytes of ``path`` from ``offset`` (to the end when ``length`` is None)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        f.seek(offset)
        left = length
        while left is None or left > 0:
            block = f.read(_CHUNK if left is None else min(_CHUNK, left))
            if not block:
                break
            h.update(block)
            if left is not None:
                left -= len(block)
    return h.hexdigest()


def _body_digest(body: Mapping[str, Any]) -> str:
    # Canonical JSON: the digest does not depend on key order or whitespace.
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _signed_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.is_file() and p.name != MANIFEST and not p.name.endswith(".tmp"))


def write_manifest(
    directory: str | os.PathLike, items: Mapping[str, Iterable[ByteRange]], values: frozenset[str] = frozenset()
) -> Path:
    """Sign every file of ``directory`` and every named byte range in ``items``; write ``manifest.json`` atomically.

    ``values``: the items that are pickled Python values rather than tensors (errors name them so).
    Call it once the directory is complete: a file changed afterwards no longer matches.
    """
    path = Path(directory)
    files = {p.name: {"sha256": file_digest(p), "bytes": p.stat().st_size} for p in _signed_files(path)}
    entries = {
        name: {
            "kind": "value" if name in values else "tensor",
            "ranges": [{**r._asdict(), "sha256": file_digest(path / r.file, r.offset, r.length)} for r in ranges],
        }
        for name, ranges in items.items()
    }
    body = {"format": _FORMAT, "files": files, "items": entries}
    text = json.dumps({**body, "sha256": _body_digest(body)}, indent=1, sort_keys=True)
    tmp = path / (MANIFEST + ".tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())  # the manifest is the commit point: it must not reach the disk after the rename
    os.replace(tmp, path / MANIFEST)
    return path / MANIFEST


def _read_manifest(path: Path, where: str) -> dict[str, Any]:
    """The manifest's body, its own digest checked."""
    if not (path / MANIFEST).is_file():
        raise CheckpointError(f"{where}: no {MANIFEST} (not written by moe-gmm, or its save did not finish)")
    try:
        manifest = json.loads((path / MANIFEST).read_bytes())
        body = {k: manifest[k] for k in ("format", "files", "items")}
        signed = manifest["sha256"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{where}, file {MANIFEST}: unreadable ({type(exc).__name__}: {exc})") from None
    if body["format"] != _FORMAT or signed != _body_digest(body):
        raise CheckpointError(f"{where}, file {MANIFEST}: does not match its own sha256 (the manifest changed)")
    return body


def _damaged_item(path: Path, name: str, items: Mapping[str, Any]) -> str | None:
    """``"tensor 'fqn'"`` (or ``"value 'key'"``) of the first item in file ``name`` whose bytes changed, if any."""
    for item, entry in items.items():
        for r in entry["ranges"]:
            if r["file"] == name and file_digest(path / name, r["offset"], r["length"]) != r["sha256"]:
                return f"{entry['kind']} {item!r}"
    return None


def verify_manifest(directory: str | os.PathLike, what: str = "checkpoint") -> dict[str, Any]:
    """Check ``directory`` against its ``manifest.json``; return the manifest (``files``, ``items``).

    Raises :class:`CheckpointError` naming the directory and the file (and the tensor whose bytes
    changed, when the damage lies in one) at the first difference: a manifest that is missing or
    not its own digest, a signed file missing, of another size or another sha256.
    """
    path = Path(directory)
    where = f"{what} {str(path)!r}"
    if not path.is_dir():
        raise CheckpointError(f"{where}: not a directory")
    body = _read_manifest(path, where)
    for name, signed in sorted(body["files"].items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{where}, file {name}: missing")
        if file.stat().st_size != signed["bytes"]:
            raise CheckpointError(f"{where}, file {name}: {file.stat().st_size} bytes, signed with {signed['bytes']}")
        if file_digest(file) != signed["sha256"]:
            item = _damaged_item(path, name, body["items"])
            blame = f"{item} does not match its sha256" if item else "does not match its sha256"
            raise CheckpointError(f"{where}, file {name}: {blame} (the data changed)")
    return body
