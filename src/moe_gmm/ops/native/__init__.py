"""Native CPU kernels: the memory-bound glue around the grouped matmul (permute/unpermute sums,
SwiGLU) and, on CPUs with AMX, the bfloat16 grouped GEMM itself.

``kernels.cpp`` holds the glue kernels and ``grouped_gemm_amx.cpp`` the AMX GEMM (read their
headers for what each computes). They are compiled on first use with the system C++ compiler against the installed torch into a per-user cache, then loaded
with ``torch.ops.load_library``; ``make setup`` builds it once up front
(``python -m moe_gmm.ops.native``). Compiling takes a while, so a build reports itself on stderr
and the ``moe_gmm`` logger: a line before, elapsed time while it runs, a line after with the time
taken; loading a cached library says nothing. The library is keyed by the
source, the torch version, the compiler and the CPU, so a change to any of them rebuilds it.

Without a working compiler the ops fall back to their composed torch paths, which compute the same
values (a warning says why once). ``MOE_GMM_NATIVE=0`` turns the kernels off;
``MOE_GMM_NATIVE_DIR`` moves the cache (default ``~/.cache/moe_gmm/native``); ``CXX`` picks the
compiler.

Why native at all: composed from torch ops, an unpermute of bfloat16 rows gathers, widens to
float32, reduces and narrows back, one pass through memory each; the kernel reads each row once
(permute+unpermute forward+backward several times faster than composed; ``docs/cpu_kernels.md``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from moe_gmm.log import logger, shows

__all__ = [
    "available",
    "build",
    "compiler",
    "disabled",
    "enabled",
    "library_path",
    "ops",
    "set_enabled",
    "unavailable_reason",
]

HEADERS = tuple(
    Path(__file__).with_name(name) for name in ("grouped_gemm_common.h", "simd_reduce.h", "simd_transpose.h")
)
SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in (
        "kernels.cpp",
        "grouped_gemm_amx.cpp",
        "grouped_gemm_avx512.cpp",
        "grouped_gemm_avx512_bf16.cpp",
        "experts_mm.cpp",
    )
)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BUILD_TIMEOUT_S = 600

_lock = threading.Lock()
_state: dict[str, object] = {"loaded": False, "reason": None, "tried": False}
_enabled = os.environ.get("MOE_GMM_NATIVE", "1").strip().lower() not in ("0", "false", "off", "no")


def compiler() -> str | None:
    """The C++ compiler the build uses (``CXX``, else c++, g++ or clang++ on PATH), or None."""
    for candidate in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if candidate and shutil.which(candidate):
            return candidate
    return None


def cpuinfo_value(*keys: str) -> str | None:
    """The value of the first /proc/cpuinfo line starting with one of ``keys``, or None (no such line,
    or no /proc/cpuinfo: not Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(keys):
                return line.split(":", 1)[1].strip() if ":" in line else ""
    except OSError:
        pass
    return None


def _cpu_signature() -> str:
    # -march=native code must not run on another CPU: the CPU's flags are part of the cache key.
    flags = cpuinfo_value("flags", "Features")
    if flags is not None:
        return flags
    import platform

    return platform.processor() or platform.machine()


def _torch_dir() -> Path:
    return Path(torch.__file__).parent


def _flags() -> list[str]:
    torch_dir = _torch_dir()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    import platform

    # gcc keeps x86 loops at 256-bit vectors unless told; the option exists on x86 only.
    x86 = ["-mprefer-vector-width=512"] if platform.machine().lower() in ("x86_64", "amd64") else []
    return [
        "-O3",
        "-march=native",
        "-fno-math-errno",
        "-fno-trapping-math",
        *x86,
        "-fopenmp",
        "-shared",
        "-fPIC",
        "-std=c++20",
        "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{torch_dir / 'include'}",
        f"-I{torch_dir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
        f"-L{torch_dir / 'lib'}",
        f"-Wl,-rpath,{torch_dir / 'lib'}",
        "-lc10",
        "-ltorch_cpu",
    ]


def _cache_dir() -> Path:
    override = os.environ.get("MOE_GMM_NATIVE_DIR")
    return Path(override) if override else Path.home() / ".cache" / "moe_gmm" / "native"


def library_path(cxx: str | None = None, sources: Sequence[Path] = SOURCES) -> Path:
    """Where the library of ``sources`` for this torch, compiler ``cxx`` and CPU lives (built or not)."""
    cxx = cxx or compiler() or "none"
    key = hashlib.sha256()
    texts = [source.read_bytes() for source in (*sources, *HEADERS)]
    for part in (*texts, torch.__version__.encode(), cxx.encode(), _cpu_signature().encode()):
        key.update(part)
        key.update(b"\0")
    key.update(" ".join(_flags()).encode())
    return _cache_dir() / f"moe_gmm_native_{key.hexdigest()[:16]}.so"


_PROGRESS_AFTER_S = 2.0  # shorter builds need no progress indicator
_PLAIN_PROGRESS_EVERY_S = 15.0  # piped stderr (CI logs): a line now and then, not one per second


def _announce(message: str) -> None:
    """``message`` on the ``moe_gmm`` logger at INFO, and on stderr when no handler would show it:
    a build pauses the first call for a while and must not do so silently."""
    logger.info(message)
    if not shows(logging.INFO):
        print(f"moe_gmm: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _build_progress() -> Iterator[Callable[[], float]]:
    """Elapsed seconds on stderr while the block runs: a rewritten line on a terminal, else a plain
    line every ``_PLAIN_PROGRESS_EVERY_S``; nothing for a block shorter than ``_PROGRESS_AFTER_S``.
    Yields the elapsed-seconds clock."""
    start = time.perf_counter()
    elapsed = lambda: time.perf_counter() - start
    done = threading.Event()
    # A replaced stderr (a progress display's proxy, a capture) buffers lines: rewriting one in place
    # would print a line per tick there, so it gets the plain lines.
    tty = sys.stderr is sys.__stderr__ and sys.stderr.isatty()
    drawn = []

    def tick() -> None:
        if done.wait(_PROGRESS_AFTER_S):
            return
        while True:
            text = f"moe_gmm: compiling the native CPU kernels, {elapsed():.0f} s so far"
            sys.stderr.write(f"\r{text}\033[K" if tty else text + "\n")
            sys.stderr.flush()
            drawn.append(True)
            if done.wait(1.0 if tty else _PLAIN_PROGRESS_EVERY_S):
                return

    thread = threading.Thread(target=tick, name="moe_gmm-native-build-progress", daemon=True)
    thread.start()
    try:
        yield elapsed
    finally:
        done.set()
        thread.join()
        if tty and drawn:  # leave the terminal line clean for what follows
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def build(*, force: bool = False, sources: Sequence[Path] = SOURCES) -> Path:
    """Compile ``sources`` (default: every kernel file) into the cache, unless already there, and
    return the library's path.

    A compilation is reported (see the module docstring); a cached library is returned silently.
    Concurrent builders (several processes of a distributed job) each compile to a private file and
    rename it into place, so a reader never sees a partial library. Raises ``RuntimeError`` with
    the compiler's output when the build fails.
    """
    if isinstance(sources, (str, Path)):
        raise TypeError(f"sources must be a sequence of paths, got the single path {str(sources)!r}")
    sources = tuple(Path(source) for source in sources)
    if not sources:
        raise ValueError("sources must name at least one C++ file, got none")
    missing = [str(source) for source in sources if not source.is_file()]
    if missing:
        raise ValueError(f"sources must be existing files, got missing {missing}")
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++)")
    target = library_path(cxx, sources)
    if target.exists() and not force:
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        # An unwritable home (some CI and container setups): a per-user temporary directory.
        fallback = Path(tempfile.gettempdir()) / f"moe_gmm_native_{os.getuid()}"
        fallback.mkdir(parents=True, exist_ok=True)
        target = fallback / target.name
        if target.exists() and not force:
            return target
    names = ", ".join(source.name for source in sources)
    _announce(
        f"compiling the native CPU kernels ({names}) with {cxx} into {target.parent}; this happens once per "
        "source, torch, compiler and CPU (`make setup` or `python -m moe_gmm.ops.native` does it ahead)"
    )
    fd, tmp_name = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [cxx, *(str(source) for source in sources), "-o", tmp_name, *_flags()]
        with _build_progress() as elapsed:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed after {elapsed():.1f} s:\n{done.stderr[-4000:]}")
        os.replace(tmp_name, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
    _announce(f"native CPU kernels built in {elapsed():.1f} s: {target}")
    return target


def _load() -> bool:
    if _state["tried"]:  # the per-call path: no lock once the first call has decided
        return bool(_state["loaded"])
    with _lock:
        if _state["tried"]:
            return bool(_state["loaded"])
        try:
            torch.ops.load_library(str(build()))
            _state["loaded"] = True
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:  # use the composed torch path
            _state["reason"] = f"{type(exc).__name__}: {exc}"
            warnings.warn(
                f"moe_gmm native CPU kernels unavailable, using the torch path: {_state['reason']}",
                RuntimeWarning,
                stacklevel=3,
            )
        # Set last: a thread on the lock-free path above sees "tried" only once "loaded" is final.
        _state["tried"] = True
        return bool(_state["loaded"])


def available() -> bool:
    """True when the kernels are enabled, built and loaded (builds them on the first call)."""
    return _enabled and _load()


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (None when it is True or was not asked yet)."""
    return _state["reason"]  # type: ignore[return-value]


def enabled() -> bool:
    """Whether the ops use the native kernels when they can (``MOE_GMM_NATIVE``; :func:`set_enabled`)."""
    return _enabled


def set_enabled(flag: bool) -> bool:
    """Turn the native kernels on or off for this process; returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(flag)
    return previous


def ops(*tensors: torch.Tensor):
    """``torch.ops.moe_gmm_native`` when every tensor is a CPU tensor of a supported dtype and the
    kernels are enabled and loaded, else None (the caller takes its torch path)."""
    if not _enabled:
        return None
    for t in tensors:
        if t.device.type != "cpu" or t.dtype not in DTYPES:
            return None
    if not _load():
        return None
    return torch.ops.moe_gmm_native


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run a block on the composed torch paths (for comparisons and tests)."""
    previous = set_enabled(False)
    try:
        yield
    finally:
        set_enabled(previous)


def main(argv: list[str] | None = None) -> int:
    """``python -m moe_gmm.ops.native``: build (or find) the library and say where it is."""
    del argv
    try:
        path = build()
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        print(f"moe_gmm native kernels: not built ({exc}); the torch paths will be used", file=sys.stderr)
        return 0
    print(f"moe_gmm native kernels: {path}")
    return 0
