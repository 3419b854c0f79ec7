"""What the machine can do, measured in the same run as the benchmark it calibrates.

A benchmark time means little on its own on a shared or virtualised CPU: the same code runs at
different speeds from one hour to the next. So every run measures its own limits and reports each result as a
ratio to the *roofline floor*, the least time the work could take on this machine:

    floor = max(flops / peak_gemm_rate[dtype], min_bytes / copy_bandwidth)

- ``peak_gemm_rate``: the best rate of one large square GEMM (n = 2048, 3072) in the benchmark's
  dtype with all of torch's threads, by either of the GEMMs this machine has: ``torch.mm`` (the
  BLAS this torch ships: MKL for fp32, oneDNN for bf16) and this library's ``cpu`` backend on one
  expert of n rows. Both count because the floor is the least time on this machine: where the
  BLAS runs generic code (MKL on AMD CPUs) the native float32 kernels run faster, and a floor from the BLAS alone would be one they beat.
  ``Limits.peak_sources`` names the GEMM that set each peak.
- ``copy_bandwidth``: a ``dst.copy_(src)`` of a buffer far larger than the caches, counting one
  read and one write per byte.
- ``min_bytes``: defined by each case (see ``moe_gmm.bench.gmm``): every operand read once and every
  result written once, nothing more.

Both limits move while a run goes on. :class:`CopyBandwidthProbe` and :class:`GemmRateProbe` measure
them again at each case: the GMM benchmark takes a case's memory floor from the bandwidth measured
next to it, and the GMM and layer benchmarks report each case's ratio to a floor from the GEMM rate
measured in its own timing rounds beside the ratio to the run's peak (``x_case_floor`` beside
``x_floor``), so a slow case can be told from a slow moment.

It also describes the machine (CPU, cores, threads, torch, BLAS, git commit, load average) for the
header of every result file.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from moe_gmm.ops.native import cpuinfo_value

__all__ = [
    "CopyBandwidthProbe",
    "GemmRateProbe",
    "Limits",
    "MachineInfo",
    "describe_machine",
    "gemm_rate_probes",
    "measure_limits",
    "roofline_floor",
]

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


@dataclass(frozen=True)
class MachineInfo:
    """Facts that decide GEMM speed, for the header of a result file."""

    cpu_model: str
    logical_cpus: int
    usable_cpus: int
    torch_threads: int
    cpu_capability: str
    torch_version: str
    python_version: str
    blas: str
    git_commit: str
    load_average: tuple[float, float, float]
    env: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)

    def one_line(self) -> str:
        load = ", ".join(f"{v:.2f}" for v in self.load_average)
        return (
            f"{self.cpu_model}, {self.usable_cpus}/{self.logical_cpus} CPUs, torch {self.torch_version} "
            f"({self.torch_threads} threads, {self.cpu_capability}), {self.blas}; "
            f"commit {self.git_commit}; load average {load}"
        )


def _cpu_model() -> str:
    return cpuinfo_value("model name") or platform.processor() or platform.machine() or "unknown"


def _blas_description() -> str:
    config = torch.__config__.show()
    parts = []
    match = re.search(r"BLAS_INFO=(\w+)", config)
    if match:
        parts.append(f"BLAS={match.group(1)}")
    match = re.search(r"Math Kernel Library Version ([\w.]+)", config)
    if match:
        parts.append(f"MKL {match.group(1)}")
    match = re.search(r"MKL-DNN v([\w.]+)", config)
    if match:
        parts.append(f"oneDNN {match.group(1)}")
    return ", ".join(parts) or "unknown"


def git_commit(path: Path | None = None) -> str:
    """Short hash of the checkout holding this package, with ``+dirty`` for local changes."""
    where = path or Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=where,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        if head.returncode != 0:
            return "unknown (not a git checkout)"
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=where,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        dirty = "+dirty" if status.stdout.strip() else ""
        return head.stdout.strip() + dirty
    except (OSError, subprocess.SubprocessError):
        return "unknown (git unavailable)"


def describe_machine() -> MachineInfo:
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count() or 1
    env_keys = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "THP_MEM_ALLOC_ENABLE", "MOE_GMM_BACKEND")
    return MachineInfo(
        cpu_model=_cpu_model(),
        logical_cpus=os.cpu_count() or 1,
        usable_cpus=usable,
        torch_threads=torch.get_num_threads(),
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        torch_version=torch.__version__,
        python_version=platform.python_version(),
        blas=_blas_description(),
        git_commit=git_commit(),
        load_average=tuple(round(v, 2) for v in os.getloadavg()),
        env={k: os.environ[k] for k in env_keys if k in os.environ},
    )


@dataclass
class Limits:
    """Measured peak GEMM rate per dtype (FLOP/s) and copy bandwidth (bytes/s)."""

    peak_flops: dict[str, float]
    copy_bandwidth: float
    gemm_sizes: tuple[int, ...]
    copy_mib: int
    seconds_spent: float = 0.0
    peak_sources: dict[str, str] = field(default_factory=dict)  # dtype -> the GEMM that set its peak

    def merged(self, other: Limits) -> Limits:
        """The higher of two measurements of each limit (e.g. before and after a run)."""
        peaks, sources = {}, {}
        for k, v in self.peak_flops.items():
            theirs = other.peak_flops.get(k, 0.0)
            best = self if v >= theirs else other
            peaks[k] = max(v, theirs)
            if k in best.peak_sources:
                sources[k] = best.peak_sources[k]
        return Limits(
            peak_flops=peaks,
            copy_bandwidth=max(self.copy_bandwidth, other.copy_bandwidth),
            gemm_sizes=self.gemm_sizes,
            copy_mib=self.copy_mib,
            seconds_spent=self.seconds_spent + other.seconds_spent,
            peak_sources=sources,
        )

    def as_dict(self) -> dict:
        return asdict(self)

    def peak(self, dtype: torch.dtype | str) -> float:
        """The peak GEMM rate of ``dtype`` (a torch dtype or its name, e.g. ``"bf16"``)."""
        name = dtype if isinstance(dtype, str) else dtype_name(dtype)
        if name not in self.peak_flops:
            raise KeyError(f"peak GEMM rate for {name} was not measured; measured: {sorted(self.peak_flops)}")
        return self.peak_flops[name]


def _best_seconds(fn, repeats: int) -> float:
    """Least time of ``repeats`` calls: a limit is what the machine can do, and on a shared machine
    other processes only ever add time, so the fastest call is the least disturbed estimate."""
    fn()  # warm-up: first-call allocation, BLAS kernel selection, page faults
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


TORCH_MM = "torch.mm"
CPU_BACKEND = "cpu backend, one expert"


def _square_gemms(a: torch.Tensor, b: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The GEMMs that compute ``a @ b`` (square, on the CPU), by name."""
    from moe_gmm.ops.backends import cpu

    c = torch.empty_like(a)
    w = b.unsqueeze(0)
    ends = torch.tensor([a.shape[0]])
    return {TORCH_MM: lambda: torch.mm(a, b, out=c), CPU_BACKEND: lambda: cpu.forward(a, w, ends)}


def measure_peak_gemm(dtype: torch.dtype, sizes: tuple[int, ...] = (2048, 3072), repeats: int = 5) -> tuple[float, str]:
    """``(FLOP/s, name)``: the best rate of one square GEMM of size ``n`` in ``sizes``, over the
    GEMMs of :func:`_square_gemms`, and the GEMM that reached it."""
    best, source = 0.0, TORCH_MM
    g = torch.Generator().manual_seed(0)
    for n in sizes:
        a = torch.randn(n, n, generator=g).to(dtype)
        b = torch.randn(n, n, generator=g).to(dtype)
        for name, gemm in _square_gemms(a, b).items():
            rate = 2.0 * n**3 / _best_seconds(gemm, repeats)
            if rate > best:
                best, source = rate, name
    return best, source


class CopyBandwidthProbe:
    """``dst.copy_(src)`` on ``mib`` MiB buffers allocated once, for measuring again and again.

    On some virtual machines the memory bandwidth flips between states within a minute (seen on an
    AMD EPYC VM; ``docs/performance.md``): the GMM benchmark
    measures it next to every case with one probe.
    """

    def __init__(self, mib: int = 256) -> None:
        numel = mib * 2**20 // 4
        self.mib = mib
        self._src = torch.ones(numel, dtype=torch.float32)
        self._dst = torch.empty_like(self._src)
        self._dst.copy_(self._src)  # first touch outside the timing: page faults are not bandwidth

    def measure(self, repeats: int = 5) -> float:
        """Best bytes/s of the copy, counting the read and the write."""
        seconds = _best_seconds(lambda: self._dst.copy_(self._src), repeats)
        return 2.0 * self._src.numel() * 4 / seconds


class GemmRateProbe:
    """One square GEMM of size ``n``, by the name of one of :func:`_square_gemms` (the one that set
    the run's peak), on operands allocated once, for measuring the machine's GEMM rate again and
    again.

    On a shared machine the rate a GEMM gets moves with the other tenants' load, within a run and
    within seconds: the GMM benchmark times the probe in the same interleaved rounds as each case's
    implementations, so a case's ratio to the floor can be read against what the machine gave in
    those very rounds.
    """

    def __init__(self, dtype: torch.dtype, source: str = TORCH_MM, n: int = 2048) -> None:
        g = torch.Generator().manual_seed(0)
        a = torch.randn(n, n, generator=g).to(dtype)
        b = torch.randn(n, n, generator=g).to(dtype)
        gemms = _square_gemms(a, b)
        if source not in gemms:
            raise ValueError(f"source must be one of {sorted(gemms)}, got {source!r}")
        self.dtype, self.source, self.n = dtype, source, n
        self.flops = 2.0 * n**3
        self.run = gemms[source]

    def measure(self, repeats: int = 2) -> float:
        """Best FLOP/s of the GEMM over ``repeats`` calls after one warm-up call."""
        return self.flops / _best_seconds(self.run, repeats)


def gemm_rate_probes(dtypes: Sequence[torch.dtype], limits: Limits) -> dict[str, GemmRateProbe]:
    """One :class:`GemmRateProbe` per dtype, keyed by its name, on the GEMM that set the dtype's peak
    in ``limits`` (``n`` = the peak's first size)."""
    return {
        dtype_name(d): GemmRateProbe(d, limits.peak_sources.get(dtype_name(d), TORCH_MM), limits.gemm_sizes[0])
        for d in dtypes
    }


def measure_copy_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """Best bytes/s of ``dst.copy_(src)`` on ``mib`` MiB, counting the read and the write."""
    return CopyBandwidthProbe(mib).measure(repeats)


def measure_limits(dtypes: tuple[torch.dtype, ...], *, quick: bool = False) -> Limits:
    """Peak GEMM rate for each of ``dtypes`` and the copy bandwidth, measured now."""
    start = time.perf_counter()
    sizes = (2048,) if quick else (2048, 3072)
    repeats = 3 if quick else 5
    measured = {dtype_name(d): measure_peak_gemm(d, sizes, repeats) for d in dtypes}
    copy_mib = 256
    bandwidth = measure_copy_bandwidth(copy_mib, repeats)
    return Limits(
        peak_flops={name: rate for name, (rate, _) in measured.items()},
        copy_bandwidth=bandwidth,
        gemm_sizes=sizes,
        copy_mib=copy_mib,
        seconds_spent=time.perf_counter() - start,
        peak_sources={name: source for name, (_, source) in measured.items()},
    )


def roofline_floor(flops: float, min_bytes: float, dtype: torch.dtype | str, limits: Limits) -> tuple[float, str]:
    """``(seconds, bound)``: the least time for the work and whether compute or memory bounds it."""
    compute_s = flops / limits.peak(dtype)
    memory_s = min_bytes / limits.copy_bandwidth
    if compute_s >= memory_s:
        return compute_s, "compute"
    return memory_s, "memory"
