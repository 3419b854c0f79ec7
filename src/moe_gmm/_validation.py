"""Checks at the public boundary shared by the config dataclasses and the command line.

:func:`check_field_types` makes a dataclass refuse, on construction, a field value that does not
match its annotation (``bool`` is not an ``int``, a string is not a ``bool``), so a wrong option
fails where it is given instead of at the first forward. :func:`writable_directory` proves an
output directory can be written before any work is done; :func:`check_fits_in_memory` that sizes
can be allocated at all.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
import types
import typing
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "available_memory_bytes",
    "check_field_types",
    "check_fits_in_memory",
    "describe_type",
    "matches_type",
    "writable_directory",
]


def describe_type(tp: Any) -> str:
    """``int``, ``str or null``, ``one of 'bf16', 'fp32'``, ``list of str``: for error messages."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_type(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        return f"{origin.__name__} of {describe_type(typing.get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def matches_type(value: Any, tp: Any) -> bool:
    """Whether ``value`` is a ``tp``, strictly: bools are not ints, ints are floats, no coercion."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin is Literal:
        return not isinstance(value, bool) and value in typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(matches_type(value, a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        item = typing.get_args(tp)[0]
        return isinstance(value, origin) and all(matches_type(v, item) for v in value)
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(tp, type):
        return isinstance(value, tp)
    raise TypeError(f"matches_type: unsupported annotation {tp!r}")  # pragma: no cover - a schema bug


@functools.cache
def _field_types(cls: type) -> tuple[tuple[str, Any], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls))


def check_field_types(obj: Any) -> None:
    """Raise ``TypeError`` naming the first field of dataclass ``obj`` whose value is not its annotation's type."""
    for name, tp in _field_types(type(obj)):
        value = getattr(obj, name)
        if not matches_type(value, tp):
            raise TypeError(
                f"{type(obj).__name__}.{name}: expected {describe_type(tp)}, got {type(value).__name__} {value!r}"
            )


def writable_directory(path: str | os.PathLike, what: str) -> Path:
    """Create ``path`` (with parents) and prove a file can be written in it; ``ValueError`` naming ``what`` if not."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        # Permissions alone do not tell (root, read-only mounts, quotas): write and remove a file.
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write_test_"):
            pass
    except OSError as exc:
        raise ValueError(f"{what} {str(path)!r}: not a writable directory ({exc.strerror or exc})") from None
    return path


def available_memory_bytes(device: str = "cpu") -> int | None:
    """Bytes that can still be allocated on ``device`` now (host: ``MemAvailable``), None when unknown."""
    if device == "cuda":
        import torch

        return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None
    if device != "cpu":
        return None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def check_fits_in_memory(needed_bytes: int, device: str, what: str) -> None:
    """``ValueError`` naming ``what`` when ``needed_bytes`` (a lower bound) exceeds what ``device`` has
    free: sizes that cannot be allocated fail before any work, not inside the allocator."""
    free = available_memory_bytes(device)
    if free is not None and needed_bytes > free:
        raise ValueError(
            f"{what}: needs at least {needed_bytes / 2**30:.1f} GiB of {device} memory, "
            f"{free / 2**30:.1f} GiB is available"
        )
