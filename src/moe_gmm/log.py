"""The ``moe_gmm`` logger: which backend ran, what the native build did.

The library attaches only a ``NullHandler``; an application's own logging configuration decides
what is shown. ``MOE_GMM_LOG=info`` (or ``debug``) in the environment, the CLI's ``--verbose`` or
:func:`enable_logging` print the library's records on stderr.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import TextIO

__all__ = ["LOGGER_NAME", "LOG_ENV_VAR", "enable_logging", "logger", "shows"]

LOGGER_NAME = "moe_gmm"
LOG_ENV_VAR = "MOE_GMM_LOG"
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}

logger = logging.getLogger(LOGGER_NAME)
logger.addHandler(logging.NullHandler())


class _OwnHandler(logging.StreamHandler):
    """The stderr handler :func:`enable_logging` adds (one at most, found again by its type)."""


def enable_logging(level: str | int = "info", stream: TextIO | None = None) -> logging.Handler:
    """Print ``moe_gmm`` records at ``level`` ("debug", "info", "warning" or a ``logging`` level) on
    ``stream`` (default stderr). Calling it again changes the level; it never adds a second handler."""
    if isinstance(level, str):
        if level.strip().lower() not in _LEVELS:
            raise ValueError(f"level must be one of {sorted(_LEVELS)} or a logging level int, got {level!r}")
        level = _LEVELS[level.strip().lower()]
    elif isinstance(level, bool) or not isinstance(level, int):
        raise TypeError(f"level must be a str or an int, got {type(level).__name__}")
    handler = next((h for h in logger.handlers if isinstance(h, _OwnHandler)), None)
    if handler is None:
        handler = _OwnHandler(stream)
        handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
        logger.addHandler(handler)
    elif stream is not None:
        handler.setStream(stream)
    handler.setLevel(level)
    logger.setLevel(level)
    return handler


def shows(level: int, target: logging.Logger = logger) -> bool:
    """Whether a record at ``level`` from ``target`` reaches a handler that prints it (not a
    ``NullHandler``), following propagation as ``logging`` does."""
    if not target.isEnabledFor(level):
        return False
    current: logging.Logger | None = target
    while current is not None:
        for h in current.handlers:
            if not isinstance(h, logging.NullHandler) and level >= h.level:
                return True
        current = current.parent if current.propagate else None
    return False


def _configure_from_env() -> None:
    value = os.environ.get(LOG_ENV_VAR, "").strip().lower()
    if not value:
        return
    if value not in _LEVELS:
        # An import must not fail over a typo in the environment: say so and carry on.
        warnings.warn(
            f"{LOG_ENV_VAR} must be one of {sorted(_LEVELS)}, got {value!r}; logging stays off",
            RuntimeWarning,
            stacklevel=2,
        )
        return
    enable_logging(value, sys.stderr)


_configure_from_env()
