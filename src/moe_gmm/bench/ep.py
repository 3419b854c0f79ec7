"""Expert-parallel dispatch benchmark on local gloo ranks.

``python -m benchmarks.run_ep [--quick] [--ep 2,4] [--out FILE]`` (or ``python -m moe_gmm.bench.ep``, from any folder)

For each case and EP size, every rank routes its own tokens (uniform top-k) to the experts of all
ranks. Measured per rank, then the slowest rank reported (a step waits for it):

- the phases of the one-chunk ``alltoall`` dispatcher, forward: ``dispatch`` (permute, count
  exchange, the host sync, all-to-all, regroup), ``experts`` (GMM -> SwiGLU -> GMM on the local
  shard), ``combine`` (inverse regroup, all-to-all back, unpermute); and ``route``, the part of
  ``dispatch`` before the token exchange (permute, count exchange, host sync, regroup indices);
- ``exchange``: the two all-to-alls alone on the same rows (the communication floor);
- forward and forward+backward of ``alltoall`` and of ``alltoall_overlap`` with 2 and 4 chunks.

Every timed call starts right after a barrier, so the ranks start together; medians of the
repeats, with the 20th/80th percentiles and the minimum in the JSON.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from moe_gmm.bench.harness import timing_from_samples
from moe_gmm.bench.machine import describe_machine

__all__ = ["EPCase", "main", "run_case"]


@dataclass(frozen=True)
class EPCase:
    name: str
    tokens: int  # per rank
    hidden: int
    inter: int
    num_experts: int
    top_k: int

    def exchange_mib(self) -> float:
        """Rows this rank sends in one all-to-all, in MiB (fp32)."""
        return self.tokens * self.top_k * self.hidden * 4 / 2**20

    def expert_gflop(self) -> float:
        """Forward FLOPs of the experts on T*k rows (both GMMs), GFLOP."""
        rows = self.tokens * self.top_k
        return 2 * rows * self.hidden * 3 * self.inter / 1e9


CASES = {
    "full": [
        EPCase("comm-heavy", tokens=1024, hidden=1024, inter=32, num_experts=16, top_k=2),
        EPCase("compute-heavy", tokens=512, hidden=256, inter=512, num_experts=16, top_k=4),
    ],
    "quick": [EPCase("quick", tokens=512, hidden=256, inter=128, num_experts=8, top_k=2)],
}
DISPATCHERS = (("alltoall", 1), ("overlap2", 2), ("overlap4", 4))


def _consecutive(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Each callable: one warm-up call, then ``repeats`` timed calls in a row, a barrier before each.

    In a row, not interleaved: alternating dispatchers of different chunk sizes (and forward with
    backward) changes the allocator's and caches' state between calls and inflated the one-chunk
    forward about 2x here, which no training step sees.
    """
    samples: dict[str, list[float]] = {}
    for name, fn in fns.items():
        fn()
        samples[name] = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return samples


def run_case(rank: int, ep: int, case: EPCase, repeats: int) -> dict[str, list[float]]:
    """Runs on every rank of the default group; returns this rank's samples (seconds) per measurement."""
    from moe_gmm.ops.expert_mlp import expert_mlp
    from moe_gmm.parallel.comm import all_to_all
    from moe_gmm.parallel.dispatcher import AllToAllDispatcher, OverlappedAllToAllDispatcher
    from moe_gmm.testing import routing_ids

    g = torch.Generator().manual_seed(rank)
    local = case.num_experts // ep
    x = torch.randn(case.tokens, case.hidden, generator=g)
    ids = routing_ids(case.tokens, case.top_k, case.num_experts, "uniform", generator=g)
    probs = torch.rand(case.tokens, case.top_k, generator=g)
    gate_up = (torch.randn(local, case.hidden, 2 * case.inter, generator=g) / case.hidden**0.5).requires_grad_(True)
    down = (torch.randn(local, case.inter, case.hidden, generator=g) / case.inter**0.5).requires_grad_(True)
    grad_out = torch.randn(case.tokens, case.hidden, generator=g)

    def experts(x_SH, group_list_L):
        return expert_mlp(x_SH, group_list_L, gate_up, down, validate=False)

    a2a = AllToAllDispatcher(case.num_experts, validate_routing=False)
    samples: dict[str, list[float]] = {"dispatch": [], "experts": [], "combine": [], "exchange": [], "route": []}
    with torch.no_grad():
        _, _, route = a2a.dispatch(x, ids, probs)
        (chunk,) = route.chunks
        sent = torch.randn(chunk.num_sent, case.hidden)
        for _ in range(repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            x3, group_list, route = a2a.dispatch(x, ids, probs)
            t1 = time.perf_counter()
            y3 = experts(x3, group_list)
            t2 = time.perf_counter()
            a2a.combine(y3, route, probs)
            t3 = time.perf_counter()
            dist.barrier()
            t4 = time.perf_counter()
            back = all_to_all(sent, chunk.output_splits, chunk.input_splits)
            all_to_all(back, chunk.input_splits, chunk.output_splits)
            t5 = time.perf_counter()
            dist.barrier()
            t6 = time.perf_counter()
            a2a._permute(x, ids, probs)  # permute + count exchange + host sync + regroup indices
            t7 = time.perf_counter()
            for key, seconds in zip(samples, (t1 - t0, t2 - t1, t3 - t2, t5 - t4, t7 - t6)):
                samples[key].append(seconds)
        for values in samples.values():
            del values[0]  # the first round warmed up

    timed = {}
    for name, chunks in DISPATCHERS:
        disp = (
            a2a
            if chunks == 1
            else OverlappedAllToAllDispatcher(case.num_experts, num_chunks=chunks, validate_routing=False)
        )

        def fwd(disp=disp):
            with torch.no_grad():
                disp(x, ids, probs, experts)

        def fwdbwd(disp=disp):
            gate_up.grad = down.grad = None
            (disp(x, ids, probs, experts) * grad_out).sum().backward()

        timed[f"fwd_{name}"], timed[f"fwdbwd_{name}"] = fwd, fwdbwd
    samples.update(_consecutive(timed, repeats))
    return samples


def _worker(rank: int, ep: int, cases: list[dict], repeats: int) -> list[dict[str, list[float]]]:
    return [run_case(rank, ep, EPCase(**c), repeats) for c in cases]


def _summarise(per_rank: list[dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    """The slowest rank's median (and its spread) per measurement, in ms; also the slowest rank's
    minimum, the least disturbed estimate when other processes share the cores."""
    out = {}
    for key in per_rank[0]:
        timings = [timing_from_samples(r[key]) for r in per_rank]
        worst = max(timings, key=lambda t: t.median_s)
        out[key] = {
            "median_ms": worst.median_s * 1e3,
            "p20_ms": worst.p20_s * 1e3,
            "p80_ms": worst.p80_s * 1e3,
            "min_ms": max(min(r[key]) for r in per_rank) * 1e3,
            "repeats": worst.repeats,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    from rich.table import Table

    from moe_gmm.parallel.launch import run_ranks
    from moe_gmm.report.render import wide_console

    p = argparse.ArgumentParser(description="Expert-parallel dispatch/combine and overlap on local gloo ranks.")
    p.add_argument("--quick", action="store_true", help="one small case, 3 repeats")
    p.add_argument("--ep", default="2,4", help="comma list of EP sizes (processes)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--out", default=None, help="write JSON here (e.g. out/bench/ep.json)")
    args = p.parse_args(argv)
    cases = CASES["quick" if args.quick else "full"]
    repeats = args.repeats or (5 if args.quick else 7)
    eps = [int(s) for s in args.ep.split(",") if s.strip()]
    for ep in eps:
        bad = [c.name for c in cases if c.num_experts % ep]
        if ep < 2 or bad:
            raise SystemExit(f"--ep: {ep} must be >= 2 and divide the experts of every case (not {bad})")
    console = wide_console()
    machine = describe_machine()
    command = "python -m moe_gmm.bench.ep " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    console.print(f"[bold]EP dispatch benchmark[/] (gloo, {machine.one_line()})")
    results = []
    for ep in eps:
        per_rank = run_ranks(_worker, ep, [asdict(c) for c in cases], repeats, timeout_s=900, pg_timeout_s=300)
        for i, case in enumerate(cases):
            summary = _summarise([r[i] for r in per_rank])
            results.append(
                {
                    "case": asdict(case),
                    "ep": ep,
                    "exchange_mib_per_rank": case.exchange_mib(),
                    "expert_gflop_per_rank": case.expert_gflop(),
                    "ms": summary,
                }
            )

    table = Table(title="slowest rank, median ms (fp32, 1 thread per rank)")
    for col in (
        "case",
        "EP",
        "MiB/a2a",
        "route",
        "dispatch",
        "experts",
        "combine",
        "2 x a2a",
        "fwd a2a",
        "fwd ovl2",
        "fwd ovl4",
        "f+b a2a",
        "f+b ovl2",
        "f+b ovl4",
        "ovl2 gain f+b",
    ):
        table.add_column(col, justify="right")
    for r in results:
        ms = {k: v["median_ms"] for k, v in r["ms"].items()}
        gain = ms["fwdbwd_alltoall"] / ms["fwdbwd_overlap2"]
        table.add_row(
            r["case"]["name"],
            str(r["ep"]),
            f"{r['exchange_mib_per_rank']:.1f}",
            *(
                f"{ms[k]:.1f}"
                for k in (
                    "route",
                    "dispatch",
                    "experts",
                    "combine",
                    "exchange",
                    "fwd_alltoall",
                    "fwd_overlap2",
                    "fwd_overlap4",
                    "fwdbwd_alltoall",
                    "fwdbwd_overlap2",
                    "fwdbwd_overlap4",
                )
            ),
            f"{gain:.2f}x",
        )
    console.print(table)
    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"command": command, "machine": machine.as_dict(), "results": results}, indent=2))
        console.print(f"wrote {path}")
    return 0


if __name__ == "__main__":  # the command recorded in results: it runs from any folder
    sys.exit(main())
