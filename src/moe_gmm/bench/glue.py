"""The memory-bound glue around the grouped matmul: permute + unpermute and SwiGLU, forward+backward.

``python -m benchmarks.run_glue`` times each op on the native CPU kernels and on the composed torch
ops they replace, side by side in one run, against a floor of minimal bytes / copy bandwidth
(measured in the same run), and prints the table and writes JSON (and optionally markdown).

Bytes counted for the floor (element size b, R = T*k rows):
permute+unpermute fwd+bwd reads and writes ``(4*T + 5*R) * H * b`` (permute: T in, R out;
unpermute: R in, T out; unpermute backward: T and R in, R out; permute backward: R in, T out);
swiglu fwd+bwd ``8 * R * I * b`` (2RI in, RI out; RI + 2RI in, 2RI out).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moe_gmm.bench.harness import TimingSettings, time_interleaved
from moe_gmm.bench.runner import restores_threads, set_threads
from moe_gmm.bench.machine import describe_machine, measure_copy_bandwidth
from moe_gmm.bench.table import markdown_table, write_outputs
from moe_gmm.ops import native
from moe_gmm.ops.permute import permute, unpermute
from moe_gmm.ops.swiglu import swiglu

__all__ = ["CASES", "GlueCase", "main", "run"]


@dataclass(frozen=True)
class GlueCase:
    num_tokens: int
    top_k: int
    hidden: int
    intermediate: int
    num_experts: int

    @property
    def name(self) -> str:
        return f"T{self.num_tokens}-k{self.top_k}-H{self.hidden}-I{self.intermediate}"


# The layer benchmark's shapes: E8 top-2 and E64 top-8 at H1024 I256 T512, Qwen3.5 E64 at T1024/4096.
CASES = (
    GlueCase(512, 2, 1024, 256, 8),
    GlueCase(512, 8, 1024, 256, 64),
    GlueCase(1024, 8, 2048, 512, 64),
    GlueCase(4096, 8, 2048, 512, 64),
)
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _permute_round_trip(case: GlueCase, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(case.num_tokens, case.hidden, generator=g).to(dtype).requires_grad_(True)
    ids = torch.rand(case.num_tokens, case.num_experts, generator=g).topk(case.top_k, dim=1).indices
    probs = torch.rand(case.num_tokens, case.top_k, generator=g).requires_grad_(True)
    grad_out = torch.randn(case.num_tokens, case.hidden, generator=g).to(dtype)

    def step():
        permuted, row_id_map, _ = permute(x, ids, case.num_experts, validate=False)
        out = unpermute(permuted, row_id_map, probs)
        return torch.autograd.grad(out, (x, probs), grad_out)

    return step


def _swiglu_round_trip(case: GlueCase, dtype: torch.dtype):
    g = torch.Generator().manual_seed(1)
    rows = case.num_tokens * case.top_k
    x = torch.randn(rows, 2 * case.intermediate, generator=g).to(dtype).requires_grad_(True)
    grad_out = torch.randn(rows, case.intermediate, generator=g).to(dtype)

    def step():
        return torch.autograd.grad(swiglu(x), x, grad_out)

    return step


def _composed(fn):
    def run():
        with native.disabled():
            return fn()

    return run


def run(
    cases: Sequence[GlueCase] = CASES, dtypes: Sequence[str] = ("fp32", "bf16"), settings: TimingSettings | None = None
) -> dict[str, Any]:
    """Time every case; returns the report (machine, bandwidth, one row per case, dtype and op)."""
    settings = settings or TimingSettings(warmup=2, min_repeats=10, max_repeats=50, min_seconds=0.5)
    if not native.available():
        raise RuntimeError(f"native kernels unavailable: {native.unavailable_reason()}")
    bandwidth = measure_copy_bandwidth()
    rows = []
    for case in cases:
        for dtype_key in dtypes:
            dtype = _DTYPES[dtype_key]
            size = dtype.itemsize
            r = case.num_tokens * case.top_k
            ops = {
                "permute+unpermute": (
                    _permute_round_trip(case, dtype),
                    (4 * case.num_tokens + 5 * r) * case.hidden * size,
                ),
                "swiglu": (_swiglu_round_trip(case, dtype), 8 * r * case.intermediate * size),
            }
            for op, (fn, nbytes) in ops.items():
                timing = time_interleaved({"native": fn, "composed": _composed(fn)}, settings)
                floor = nbytes / bandwidth
                nat, comp = timing["native"].median_s, timing["composed"].median_s
                rows.append(
                    {
                        "case": case.name,
                        "dtype": dtype_key,
                        "op": op,
                        "floor_ms": floor * 1e3,
                        "native_ms": nat * 1e3,
                        "composed_ms": comp * 1e3,
                        "native_x_floor": nat / floor,
                        "composed_x_floor": comp / floor,
                        "speedup": comp / nat,
                    }
                )
    return {
        "machine": describe_machine().as_dict(),
        "threads": torch.get_num_threads(),
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "rows": rows,
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"copy bandwidth {report['copy_bandwidth_gb_s']:.1f} GB/s, {report['threads']} threads",
        "",
    ]
    header = ("case", "dtype", "op", "floor ms", "native ms (x floor)", "composed ms (x floor)", "native speed-up")
    cells = [
        (
            row["case"],
            row["dtype"],
            row["op"],
            f"{row['floor_ms']:.3f}",
            f"{row['native_ms']:.3f} ({row['native_x_floor']:.2f}x)",
            f"{row['composed_ms']:.3f} ({row['composed_x_floor']:.2f}x)",
            f"{row['speedup']:.2f}x",
        )
        for row in report["rows"]
    ]
    return "\n".join(lines + markdown_table(header, cells)) + "\n"


@restores_threads
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="fp32,bf16", help="comma-separated: fp32, bf16")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="the first case only, few repeats")
    parser.add_argument("--out", type=Path, default=Path("out/bench/glue.json"))
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args(argv)
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in _DTYPES]
    if bad:
        parser.error(f"--dtype: unknown {bad}; choose from {list(_DTYPES)}")
    set_threads(args.threads)
    settings = TimingSettings(warmup=1, min_repeats=3, max_repeats=5, min_seconds=0.0) if args.quick else None
    report = run(CASES[:1] if args.quick else CASES, dtypes, settings)
    text = markdown(report)
    print(text, end="")
    write_outputs(report, text, args.out, args.markdown)
    return 0
