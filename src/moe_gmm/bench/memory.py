"""Peak memory of one layer's forward+backward step, against the bytes the step cannot do without.

Definitions (the memory table's caption repeats them):

- ``budget`` = the layer's weights + their grads (the same bytes) + the input ``x`` and its grad
  ``dx`` + the activations autograd saves during one forward. Saved activations are caught with
  :func:`torch.autograd.graph.saved_tensors_hooks` and counted by unique *storage*
  (``untyped_storage().data_ptr()``, the storage's ``nbytes``), leaving out storages that belong to
  a weight or to the input (already counted). Weights are counted by unique storage too, since a
  benchmark may hand them over as views (``moe_gmm``'s transposed expert weights).
- ``peak`` = the process's resident-memory high-water mark (``VmHWM`` in ``/proc/self/status``)
  during one steady-state forward+backward step, minus the resident memory (``VmRSS``) measured
  just before the layer's weights and input were created. It counts everything real: allocator
  caches, fragmentation, a library's reusable buffers, thread-pool stacks.
- ``tensor peak`` = the largest number of bytes held by live CPU tensors at any moment of one
  steady-state step: the weights' and input's storages plus the high-water mark of the tensor bytes
  allocated during the step (torch's CPU allocator reports every allocation and free to
  ``torch.profiler`` under ``profile_memory=True``; this is the CPU analogue of
  ``torch.cuda.max_memory_allocated``). It measures the algorithm's own memory; ``peak`` adds what
  the allocators keep (glibc's heap, :mod:`moe_gmm.ops.host_cache`), one-time library state and
  page granularity. It is taken with the host cache off (the same tensors, each from torch's
  allocator, so the profiler sees them) on the already warmed-up layer, after ``peak``. Not seen:
  memory a library takes from ``malloc`` directly (oneDNN's and MKL's scratch, native kernels'
  per-thread row buffers).
- target: ``peak / budget <= 1.2``.

Procedure, in a fresh process per implementation (resident memory is process-wide: building one
implementation leaves pages behind that the next would reuse unseen): *prime* the process with one
step of the same implementation on a tiny shape, so lazy imports land before the baseline (the first
``torch.autograd.grad`` alone imports ``torch.fx.experimental.symbolic_shapes`` and sympy, about
30 MiB; transformers imports its modelling code on first use); create the upstream gradient ``dy``
(the caller's tensor; counted in neither number); ``gc.collect()`` and ``malloc_trim`` (glibc, so
freed heap pages from the priming are not reused for free), read the baseline; build the layer,
drop what it does not use (the benchmark's inputs hold the weights in two layouts), collect and
trim again (the build's temporaries are not the step's memory); run ``warmup_steps`` steps
(default :data:`WARMUP_STEPS`: allocator caches, thread pools, and the heap's steady state, below),
``gc.collect()``, reset the high-water mark by writing ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0),
run ``measured_steps`` steps (default :data:`MEASURED_STEPS`) and take the high-water mark over all of
them. The step is the benchmark's ``fwdbwd`` mode: ``torch.autograd.grad(forward(), leaves, dy)``.
If the reset is refused or has no effect, ``peak`` is reported as unavailable rather than a number
that includes the build.

Why several warm-up steps: glibc's heap reaches its steady size only after a few steps. Blocks freed
in one step do not always fit where the next step asks, so the heap grows for a while: the float32
E8 layer of the ``experts`` set (weights 27 MiB) grew by 15 MiB over its first five steps and then
not at all over 35 more; one warm-up step reported 1.33x its budget where the steady state is
higher. The record keeps both counts (``warmup_steps``, ``measured_steps``) and ``drift``: how much
resident memory grew from the first measured step's start to the last one's end (0 in a steady
state).

The allocator shapes ``peak``: glibc's malloc serves blocks below its (adaptive, up to 32 MiB) mmap
threshold from heaps it keeps resident after ``free``, so pages freed by one tensor are held until
reused. ``MALLOC_MMAP_THRESHOLD_=131072`` in the environment (inherited by the measuring processes)
gives every block of 128 KiB or more its own mapping, returned on free; each record keeps the
``MALLOC_*`` and ``LD_PRELOAD`` variables it ran under (``malloc_env``).

Not seen by ``budget``: tensors an autograd function keeps as plain ``ctx`` attributes instead of
``save_for_backward`` (moe-gmm's ops keep only Python scalars there). The step's output ``y`` is in
``peak`` while the backward runs but in ``budget`` only where autograd saved it.

``--prime full`` primes with one step of the same layer at full size instead (its weights dropped,
:func:`moe_gmm.ops.host_cache.clear` and ``malloc_trim`` after it): what stays from that step is the
process's one-time state for these shapes (oneDNN's compiled kernels and primitive cache, per-thread
scratch of native kernels), which then falls in the baseline. The difference between the two primings
is that state's share of ``peak``; the record says which priming it ran under (``prime``).

Run one measurement: ``python -m moe_gmm.bench.memory moe_layer '{"case": {...}, "dtype": "bf16",
"impl": "moe_gmm"}' --threads 2 [--prime full]`` prints one JSON line. Kinds: ``moe_layer`` (a
:class:`~moe_gmm.bench.moe_layer.MoeLayerCase` and one of its implementations) and ``linear``
(``sigmoid(x @ w)``, a layer with nothing to hide, to calibrate the measure).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import math
import os
import subprocess
import sys
import weakref
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from moe_gmm.bench.harness import Workload, _timed_callable
from moe_gmm.bench.machine import DTYPE_NAMES
from moe_gmm.bench.table import markdown_table

__all__ = [
    "KINDS",
    "MEMORY_CAPTION",
    "PRIMINGS",
    "TARGET_RATIO",
    "Budget",
    "Peak",
    "layer_budget",
    "live_tensor_peak_bytes",
    "measure_in_subprocess",
    "measure_peak",
    "measure_workload",
    "memory_markdown",
    "print_memory_table",
    "saved_activation_bytes",
    "unique_storage_bytes",
]

MIB = 2**20
TARGET_RATIO = 1.2
WARMUP_STEPS = 8
MEASURED_STEPS = 3
MEMORY_CAPTION = (
    f"peak = resident-memory high-water mark (VmHWM) over {MEASURED_STEPS} fwd+bwd steps after {WARMUP_STEPS} "
    "warm-up steps (unless noted), minus resident memory before the weights and input existed (fresh process "
    "per impl); budget = weights + their grads + x and dx + activations autograd saves in the forward (unique "
    "storages); held = resident between steps, before the measured ones; drift = resident growth over the "
    "measured steps; tensor peak = weights + x + the most tensor bytes allocated and not yet freed at any moment "
    f"of one step (torch.profiler's memory events, host cache off); target peak/budget <= {TARGET_RATIO}"
)


def unique_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once, in full)."""
    sizes = {}
    for t in tensors:
        storage = t.untyped_storage()
        sizes[storage.data_ptr()] = storage.nbytes()
    return sum(sizes.values())


def saved_activation_bytes(forward_fn: Callable[[], Any], params: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages autograd saves while ``forward_fn()`` runs, except those of ``params``.

    Counts the storages still held by the graph when the forward returns (a saved tensor whose
    graph branch was dropped mid-forward is not held by the step). The forward's output is dropped;
    the graph built here is for counting only (no backward runs through it).
    """
    excluded = {t.untyped_storage().data_ptr() for t in params}
    records: list[tuple[weakref.ref, int, int]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        # The graph keeps a detached alias (same storage, nothing copied): returning a saved output
        # itself would tie it to its own grad_fn in a cycle that outlives a dropped branch.
        saved = t.detach()
        storage = saved.untyped_storage()
        if storage.data_ptr() not in excluded:
            records.append((weakref.ref(saved), storage.data_ptr(), storage.nbytes()))
        return saved

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward_fn()
    held = {ptr: nbytes for ref, ptr, nbytes in records if ref() is not None}
    del out
    return sum(held.values())


@dataclass(frozen=True)
class Budget:
    """Bytes the step cannot do without; ``inputs`` is ``x`` and ``dx``."""

    weights: int
    grads: int
    saved: int
    inputs: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.saved + self.inputs


def layer_budget(workload: Workload, *, num_inputs: int = 1) -> Budget:
    """The budget of ``workload``: its first ``num_inputs`` leaves are inputs, the rest weights."""
    inputs, weights = workload.leaves[:num_inputs], workload.leaves[num_inputs:]
    weight_bytes = unique_storage_bytes(weights)
    return Budget(
        weights=weight_bytes,
        grads=weight_bytes,
        saved=saved_activation_bytes(workload.forward, workload.leaves),
        inputs=2 * unique_storage_bytes(inputs),
    )


def _resident() -> tuple[int, int] | None:
    """``(VmRSS, VmHWM)`` in bytes from one read of ``/proc/self/status``; None off Linux."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    try:
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024
    except (KeyError, ValueError, IndexError):
        return None


def _reset_high_water_mark() -> str | None:
    """Reset ``VmHWM`` to the current ``VmRSS``; the reason when that cannot be done."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as exc:
        return f"peak unavailable: writing 5 to /proc/self/clear_refs failed ({exc})"
    now = _resident()
    if now is None or now[1] - now[0] > MIB:  # a working reset leaves VmHWM at VmRSS
        return "peak unavailable: writing 5 to /proc/self/clear_refs did not reset VmHWM"
    return None


def _trim_heap() -> None:
    """Hand freed heap pages back to the OS (glibc ``malloc_trim``); a no-op elsewhere."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@dataclass(frozen=True)
class Peak:
    """Resident bytes relative to ``baseline`` (before the layer existed); ``peak`` None when unmeasurable."""

    baseline: int
    held: int  # resident between steps (weights, x, caches), just before the measured steps
    peak: int | None
    drift: int = 0  # resident growth over the measured steps (0 once the heap is steady)
    note: str = ""


Job = tuple[Callable[[], Workload], torch.Tensor]  # (build the layer, upstream gradient dy)


PRIMINGS = ("tiny", "full")


def _prime(job: Job) -> None:
    """One step on a throwaway layer: lazy imports and one-time initialisation happen here.

    Memory the step left in :mod:`moe_gmm.ops.host_cache` is returned: a full-size priming would
    otherwise hand the measured step ready storages that its own first step has to allocate.
    """
    from moe_gmm.ops import host_cache

    build, grad_out = job
    grads = _timed_callable(build(), "fwdbwd", grad_out)()
    del grads
    host_cache.clear()


def _run_steps(step: Callable[[], Any], count: int) -> None:
    """``count`` steps, each one's gradients dropped and garbage collected before the next."""
    for _ in range(count):
        grads = step()
        del grads
        gc.collect()


def measure_peak(
    build: Callable[[], Workload],
    grad_out: torch.Tensor,
    *,
    warmup_steps: int = WARMUP_STEPS,
    measured_steps: int = MEASURED_STEPS,
) -> tuple[Peak, Workload]:
    """Build the layer after a baseline reading, warm it up, then measure the resident peak of its steps.

    ``build`` creates the weights and input and returns the workload (only what it returns should
    stay referenced); ``grad_out`` is the upstream gradient, created by the caller beforehand. Prime
    the process first (:func:`measure_workload` does). ``peak`` is the high-water mark over
    ``measured_steps`` fwd+bwd steps after ``warmup_steps`` unmeasured ones. Returns the workload
    too, so the budget can be counted on the same tensors afterwards.
    """
    for name, value in (("warmup_steps", warmup_steps), ("measured_steps", measured_steps)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    gc.collect()
    _trim_heap()
    before = _resident()
    workload = build()
    gc.collect()
    _trim_heap()  # the build's temporaries (other layouts, fp32 init) are not the step's memory
    step = _timed_callable(workload, "fwdbwd", grad_out)
    _run_steps(step, warmup_steps)  # allocator caches, thread pools, lazily built kernels, the heap's size
    if before is None:
        return Peak(baseline=0, held=0, peak=None, note="peak unavailable: no /proc/self/status"), workload
    ready = _resident()
    note = _reset_high_water_mark()
    _run_steps(step, measured_steps)
    after = _resident()
    assert ready is not None and after is not None
    peak = None if note else after[1] - before[0]
    return (
        Peak(baseline=before[0], held=ready[0] - before[0], peak=peak, drift=after[0] - ready[0], note=note or ""),
        workload,
    )


def live_tensor_peak_bytes(workload: Workload, grad_out: torch.Tensor) -> int:
    """The most bytes live CPU tensors hold at any moment of one fwd+bwd step of ``workload``.

    That is the storages of ``workload.leaves`` (weights and input, alive throughout) plus the
    high-water mark of the bytes torch's CPU allocator hands out and takes back during the step, as
    ``torch.profiler`` records them (``profile_memory=True``). ``grad_out`` is the caller's and
    counted nowhere. :mod:`moe_gmm.ops.host_cache` is off for the step (and one step before it, so
    no cached storage is handed out unseen), then set back: with it on, a reused storage is no
    allocation and would be missed. Run it on a warmed-up layer.
    """
    from torch.profiler import ProfilerActivity, profile

    from moe_gmm.ops import host_cache

    step = _timed_callable(workload, "fwdbwd", grad_out)
    limit = host_cache.limit_bytes()
    host_cache.set_limit_bytes(0)
    host_cache.clear()
    try:
        _run_steps(step, 1)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            _run_steps(step, 1)
        events = prof.profiler.kineto_results.events()
        # Stable sort: an allocation and its free can share a timestamp; the record order keeps them right.
        changes = [e.nbytes() for e in sorted(events, key=lambda e: e.start_ns()) if e.name() == "[memory]"]
    finally:
        host_cache.set_limit_bytes(limit)
    live = high = 0
    for change in changes:
        live += change
        high = max(high, live)
    return unique_storage_bytes(workload.leaves) + high


def measure_workload(
    job: Job,
    *,
    prime: Job | None = None,
    num_inputs: int = 1,
    warmup_steps: int = WARMUP_STEPS,
    measured_steps: int = MEASURED_STEPS,
) -> dict[str, Any]:
    """Prime with ``prime`` (the same layer, tiny), measure the peak of ``job``, then count its budget.

    Returns one flat, JSON-ready record in bytes.
    """
    if prime is not None:
        _prime(prime)
        del prime
    peak, workload = measure_peak(*job, warmup_steps=warmup_steps, measured_steps=measured_steps)
    tensor_peak = live_tensor_peak_bytes(workload, job[1])
    budget = layer_budget(workload, num_inputs=num_inputs)
    ratio = peak.peak / budget.total if peak.peak is not None and budget.total else None
    return {
        **{f"{k}_bytes": v for k, v in asdict(budget).items()},
        "budget_bytes": budget.total,
        "peak_bytes": peak.peak,
        "held_bytes": peak.held,
        "drift_bytes": peak.drift,
        "baseline_rss_bytes": peak.baseline,
        "warmup_steps": warmup_steps,
        "measured_steps": measured_steps,
        "ratio": ratio,
        "tensor_peak_bytes": tensor_peak,
        "tensor_ratio": tensor_peak / budget.total if budget.total else None,
        "note": peak.note,
        "threads": torch.get_num_threads(),
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_") or k == "LD_PRELOAD"},
    }


def _dtype(name: str) -> torch.dtype:
    by_name = {v: k for k, v in DTYPE_NAMES.items()}
    if name not in by_name:
        raise ValueError(f"dtype must be one of {sorted(by_name)}, got {name!r}")
    return by_name[name]


def _moe_layer_workload(spec: dict[str, Any]) -> Job:
    """``spec``: ``{"case": MoeLayerCase.params(), "dtype": "bf16", "impl": "moe_gmm"}``."""
    from moe_gmm.bench.moe_layer import IMPLS, MoeLayerCase, layer_impls

    dtype = _dtype(spec["dtype"])
    if spec["impl"] not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {spec['impl']!r}")
    case = MoeLayerCase(**spec["case"])
    (impl,) = [i for i in layer_impls([spec["impl"]]) if i.name == spec["impl"]]
    grad_out = torch.randn(1, case.num_tokens, case.hidden, generator=torch.Generator().manual_seed(1)).to(dtype)

    def build() -> Workload:
        inputs = case.make_inputs(dtype)
        workload = impl.prepare(inputs)
        # The inputs hold the weights twice (transformers' block and ours); the workload keeps
        # references to what it runs on, so dropping both blocks frees only the unused copy.
        inputs.hf_block = inputs.block = None
        return workload

    return build, grad_out


def _linear_workload(spec: dict[str, Any]) -> Job:
    """``spec``: ``{"rows": M, "inner": K, "cols": N, "dtype": "fp32"}``; the layer ``sigmoid(x_MK @ w_KN)``."""
    dtype = _dtype(spec["dtype"])
    m, k, n = spec["rows"], spec["inner"], spec["cols"]
    g = torch.Generator().manual_seed(0)
    grad_out = torch.randn(m, n, generator=g).to(dtype)

    def build() -> Workload:
        x_MK = torch.randn(m, k, generator=g).to(dtype).requires_grad_(True)
        w_KN = (torch.randn(k, n, generator=g) * k**-0.5).to(dtype).requires_grad_(True)
        return Workload(forward=lambda: torch.sigmoid(x_MK @ w_KN), leaves=(x_MK, w_KN))

    return build, grad_out


def _tiny_moe_layer(spec: dict[str, Any]) -> dict[str, Any]:
    # Same experts, top-k, dtype and implementation (the same code paths), tiny matrices.
    return {
        **spec,
        "case": {**spec["case"], "num_tokens": 8, "hidden": 16, "intermediate": 8, "shared_intermediate": 8},
    }


def _tiny_linear(spec: dict[str, Any]) -> dict[str, Any]:
    return {**spec, "rows": 8, "inner": 8, "cols": 8}


# kind -> (the job for a spec, the spec of the same layer on a tiny shape, for priming)
KINDS: dict[str, tuple[Callable[[dict[str, Any]], Job], Callable[[dict[str, Any]], dict[str, Any]]]] = {
    "moe_layer": (_moe_layer_workload, _tiny_moe_layer),
    "linear": (_linear_workload, _tiny_linear),
}


def measure_in_subprocess(
    kind: str,
    spec: dict[str, Any],
    *,
    threads: int | None = None,
    prime: str = "tiny",
    warmup_steps: int = WARMUP_STEPS,
    measured_steps: int = MEASURED_STEPS,
    timeout_s: float = 1800.0,
) -> dict[str, Any]:
    """Run one measurement in a fresh Python process (``threads``: default this process's setting;
    ``prime``: ``tiny`` or ``full``; the step counts as in :func:`measure_peak`; see the module's docstring)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {sorted(KINDS)}, got {kind!r}")
    if prime not in PRIMINGS:
        raise ValueError(f"prime must be one of {PRIMINGS}, got {prime!r}")
    threads = threads or torch.get_num_threads()
    cmd = [sys.executable, "-m", "moe_gmm.bench.memory", kind, json.dumps(spec), "--threads", str(threads)]
    cmd += ["--prime", prime, "--warmup-steps", str(warmup_steps), "--measured-steps", str(measured_steps)]
    env = dict(os.environ)
    # The child imports this very package, wherever it came from (a source tree or site-packages).
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s, check=False)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"memory measurement {kind} {spec} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(lines[-1])


def _mib(value: int | None) -> str:
    if value is None:
        return "-"
    return f"{value / MIB:.1f}" if abs(value) >= 10 * MIB else f"{value / MIB:.3f}"


_HEADER = (
    "case", "dtype", "impl", "weights", "grads", "saved act.", "x+dx", "budget", "held", "drift", "peak", "peak/budget",
    "tensor peak", "tensor/budget",
)  # fmt: skip


def _ratio_text(ratio: float | None) -> str:
    return "-" if ratio is None or not math.isfinite(ratio) else f"{ratio:.2f}"


def _memory_rows(records: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for r in records:
        head = [r["case"], r["dtype"], r["impl"]]
        if r.get("error"):
            rows.append([*head, *(["-"] * 8), "error", "-", "-"])
            continue
        parts = ("weights", "grads", "saved", "inputs", "budget", "held", "drift", "peak")
        row = [*head, *(_mib(r.get(f"{p}_bytes")) for p in parts), _ratio_text(r["ratio"])]
        # Records written before the tensor peak existed have no such field.
        rows.append([*row, _mib(r.get("tensor_peak_bytes")), _ratio_text(r.get("tensor_ratio"))])
    return rows


def _notes(records: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in records:
        env = " ".join(f"{k}={v}" for k, v in (r.get("malloc_env") or {}).items())
        steps = (r.get("warmup_steps", WARMUP_STEPS), r.get("measured_steps", MEASURED_STEPS))
        counted = f"{steps[1]} steps measured after {steps[0]}" if steps != (WARMUP_STEPS, MEASURED_STEPS) else ""
        parts = (r.get("error") or r.get("note"), f"ran under {env}" if env else "", counted)
        text = "; ".join(t for t in parts if t)
        if text:
            out.append(f"{r['case']} {r['dtype']} {r['impl']}: {text}")
    return out


def print_memory_table(records: list[dict[str, Any]], console=None) -> None:
    """The memory table (MiB) with ``rich``; ``held`` is resident between steps, before the measured one."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title="peak memory of one fwd+bwd step (MiB)", caption=MEMORY_CAPTION, header_style="bold")
    for i, name in enumerate(_HEADER):
        table.add_column(name, justify="left" if i < 3 else "right")
    for row in _memory_rows(records):
        table.add_row(*row)
    console.print(table)
    for line in _notes(records):
        console.print(line, highlight=False)


def memory_markdown(records: list[dict[str, Any]]) -> str:
    """The same table as Markdown."""
    out = ["peak memory of one fwd+bwd step (MiB)", "", MEMORY_CAPTION + ".", ""]
    out += markdown_table(_HEADER, _memory_rows(records), right=range(3, len(_HEADER)))
    out += [f"- {line}" for line in _notes(records)]
    return "\n".join(out) + "\n"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    """Subprocess entry: measure one workload, print one JSON line."""
    p = argparse.ArgumentParser(description="Peak memory of one fwd+bwd step vs its budget (one JSON line).")
    p.add_argument("kind", choices=sorted(KINDS))
    p.add_argument("spec", help="JSON object describing the workload (see the kind's builder)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument(
        "--prime",
        choices=PRIMINGS,
        default="tiny",
        help="prime with one step on tiny matrices (default) or on the same layer at full size, so the "
        "process's one-time state for these shapes falls in the baseline",
    )
    p.add_argument(
        "--warmup-steps",
        type=_positive_int,
        default=WARMUP_STEPS,
        help=f"unmeasured steps before the measured ones, until the heap is steady (default {WARMUP_STEPS})",
    )
    p.add_argument(
        "--measured-steps",
        type=_positive_int,
        default=MEASURED_STEPS,
        help=f"steps whose high-water mark is the peak (default {MEASURED_STEPS})",
    )
    args = p.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    make_job, tiny = KINDS[args.kind]
    spec = json.loads(args.spec)
    prime = make_job(tiny(spec) if args.prime == "tiny" else spec)
    job = make_job(spec)  # creates dy: before the baseline
    record = measure_workload(job, prime=prime, warmup_steps=args.warmup_steps, measured_steps=args.measured_steps)
    print(json.dumps({**record, "prime": args.prime}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
