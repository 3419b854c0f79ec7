"""Peak memory of one MoE layer's forward+backward step, against the bytes the step cannot do without.

- ``budget`` = the layer's weights + their grads (the same bytes) + the input ``x`` and its grad
  ``dx`` + the activations autograd saves during one forward, counted by unique storage (weights
  may be handed over as views), leaving out storages of the weights and the input.
- ``peak`` = the process's resident-memory high-water mark (``VmHWM``) over :data:`MEASURED_STEPS`
  fwd+bwd steps after :data:`WARMUP_STEPS` unmeasured ones, minus the resident memory before the
  layer's weights and input existed. It counts everything real: allocator caches, fragmentation,
  a library's reusable buffers.
- target: ``peak / budget <= 1.2``.

Each measurement runs in a fresh process (resident memory is process-wide: one implementation's
pages would hide the next one's), primed by one step of the same layer on tiny matrices so lazy
imports land before the baseline. The warm-up steps let the heap reach its steady size. Where the
high-water mark cannot be reset (``/proc/self/clear_refs``, Linux), ``peak`` is reported as
unavailable rather than a number that includes the build.

One measurement: ``python -m moe_gmm.bench.memory '{"case": {...}, "dtype": "bf16", "impl": "moe_gmm"}'
--threads 2`` prints one JSON line (``case``: :meth:`~moe_gmm.bench.layer_cases.MoeLayerCase.params`).
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
from moe_gmm.bench.runner import restores_threads, set_threads
from moe_gmm.bench.layer_cases import IMPLS, MoeLayerCase, layer_impls
from moe_gmm.bench.machine import DTYPE_NAMES
from moe_gmm.bench.table import markdown_table

__all__ = [
    "MEMORY_CAPTION",
    "TARGET_RATIO",
    "Budget",
    "Peak",
    "layer_budget",
    "measure_in_subprocess",
    "measure_peak",
    "measure_workload",
    "memory_markdown",
    "moe_layer_job",
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
    "warm-up steps, minus resident memory before the weights and input existed (fresh process per impl); "
    "budget = weights + their grads + x and dx + activations autograd saves in the forward (unique storages); "
    f"held = resident between steps, before the measured ones; target peak/budget <= {TARGET_RATIO}"
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
    note: str = ""


Job = tuple[Callable[[], Workload], torch.Tensor]  # (build the layer, upstream gradient dy)


def _prime(job: Job) -> None:
    """One step on a throwaway layer: lazy imports and one-time initialisation happen here.

    Memory the step left in :mod:`moe_gmm.ops.host_cache` is returned, so the measured step
    allocates its own storages.
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
    stay referenced); ``grad_out`` is the upstream gradient, created by the caller beforehand.
    Returns the workload too, so the budget can be counted on the same tensors afterwards.
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
    _run_steps(step, warmup_steps)
    if before is None:
        return Peak(baseline=0, held=0, peak=None, note="peak unavailable: no /proc/self/status"), workload
    ready = _resident()
    note = _reset_high_water_mark()
    _run_steps(step, measured_steps)
    after = _resident()
    assert ready is not None and after is not None
    peak = None if note else after[1] - before[0]
    return Peak(baseline=before[0], held=ready[0] - before[0], peak=peak, note=note or ""), workload


def measure_workload(job: Job, *, prime: Job | None = None) -> dict[str, Any]:
    """Prime with ``prime`` (the same layer, tiny), measure the peak of ``job``, then count its budget.

    Returns one flat, JSON-ready record in bytes.
    """
    if prime is not None:
        _prime(prime)
        del prime
    peak, workload = measure_peak(*job)
    budget = layer_budget(workload)
    ratio = peak.peak / budget.total if peak.peak is not None and budget.total else None
    return {
        **{f"{k}_bytes": v for k, v in asdict(budget).items()},
        "budget_bytes": budget.total,
        "peak_bytes": peak.peak,
        "held_bytes": peak.held,
        "baseline_rss_bytes": peak.baseline,
        "ratio": ratio,
        "note": peak.note,
        "threads": torch.get_num_threads(),
    }


def _dtype(name: str) -> torch.dtype:
    by_name = {v: k for k, v in DTYPE_NAMES.items()}
    if name not in by_name:
        raise ValueError(f"dtype must be one of {sorted(by_name)}, got {name!r}")
    return by_name[name]


def moe_layer_job(spec: dict[str, Any]) -> Job:
    """``spec``: ``{"case": MoeLayerCase.params(), "dtype": "bf16", "impl": "moe_gmm"}``."""
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


def _tiny(spec: dict[str, Any]) -> dict[str, Any]:
    # Same experts, top-k, dtype and implementation (the same code paths), tiny matrices.
    return {
        **spec,
        "case": {**spec["case"], "num_tokens": 8, "hidden": 16, "intermediate": 8, "shared_intermediate": 8},
    }


def measure_in_subprocess(spec: dict[str, Any], *, threads: int | None = None, timeout_s: float = 1800.0) -> dict:
    """Run one measurement of :func:`moe_layer_job`'s ``spec`` in a fresh Python process
    (``threads``: default this process's setting)."""
    moe_layer_job(spec)  # a bad spec fails here, with its own message, not as a child's traceback
    threads = threads or torch.get_num_threads()
    cmd = [sys.executable, "-m", "moe_gmm.bench.memory", json.dumps(spec), "--threads", str(threads)]
    env = dict(os.environ)
    # The child imports this very package, wherever it came from (a source tree or site-packages).
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s, check=False)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"memory measurement {spec} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(lines[-1])


def _mib(value: int | None) -> str:
    if value is None:
        return "-"
    return f"{value / MIB:.1f}" if abs(value) >= 10 * MIB else f"{value / MIB:.3f}"


_HEADER = ("case", "dtype", "impl", "weights", "grads", "saved act.", "x+dx", "budget", "held", "peak", "peak/budget")


def _memory_rows(records: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for r in records:
        head = [r["case"], r["dtype"], r["impl"]]
        if r.get("error"):
            rows.append([*head, *(["-"] * 7), "error"])
            continue
        parts = ("weights", "grads", "saved", "inputs", "budget", "held", "peak")
        ratio = r.get("ratio")
        ratio_text = "-" if ratio is None or not math.isfinite(ratio) else f"{ratio:.2f}"
        rows.append([*head, *(_mib(r.get(f"{p}_bytes")) for p in parts), ratio_text])
    return rows


def _notes(records: list[dict[str, Any]]) -> list[str]:
    return [
        f"{r['case']} {r['dtype']} {r['impl']}: {r.get('error') or r['note']}"
        for r in records
        if r.get("error") or r.get("note")
    ]


def print_memory_table(records: list[dict[str, Any]], console=None) -> None:
    """The memory table (MiB) with ``rich``."""
    from rich.table import Table

    from moe_gmm.report.render import wide_console

    console = console or wide_console()
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


@restores_threads
def main(argv: list[str] | None = None) -> int:
    """Subprocess entry: measure one layer, print one JSON line."""
    p = argparse.ArgumentParser(description="Peak memory of one fwd+bwd step vs its budget (one JSON line).")
    p.add_argument("spec", help='JSON: {"case": MoeLayerCase params, "dtype": "fp32"|"bf16", "impl": name}')
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = p.parse_args(argv)
    set_threads(args.threads)
    spec = json.loads(args.spec)
    prime = moe_layer_job(_tiny(spec))
    job = moe_layer_job(spec)  # creates dy: before the baseline
    print(json.dumps(measure_workload(job, prime=prime)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
