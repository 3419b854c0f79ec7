"""One command for a CUDA machine: check the GPU backends, then time them on Qwen3.5 MoE shapes.

    python benchmarks/gpu_check.py                      # writes out/gpu_check.json
    python benchmarks/gpu_check.py --dry-run --out /tmp/gpu_check.json   # CPU, Triton interpreter

1. Correctness (fails loudly, exit status 1): the triton backend in fp32 / fp16 / bf16 and the torch
   backend in bf16, forward and backward, against the float64 reference of ``moe_gmm.testing``
   (relative-norm error within the project's tolerance) on shapes with empty experts, ragged K / N
   tails and a transposed weight; empty experts' grad_weight must be exactly zero.
2. Timing (bf16, CUDA events, median of repeats after warm-up): for each Qwen3.5 expert GEMM
   (gate_up ``[R, H] @ [E, H, 2I]`` and down ``[R, I] @ [E, I, H]``) the triton, torch and eager
   backends and a dense cuBLAS ``torch.mm`` of the same FLOPs (``[R, K] @ [K, N]``), forward and
   forward+backward; TFLOP/s and the fraction of the dense rate. R = tokens * top_k rows routed to
   the local experts, uniformly at random (with EP the average rank receives tokens * top_k rows).
   The fused gather/scatter MoE MLP is compared with the unfused one (time and peak memory).

Shapes: qwen3.5-397b-ep16: hidden 4096, moe_intermediate 1024, 512 experts over EP 16 = 32 local,
top-k 10; qwen3.5-35b: hidden 2048, moe_intermediate 512, 256 experts, top-k 8; 4k and 16k tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if "--dry-run" in sys.argv:  # must precede the first Triton kernel definition
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Check the code of this checkout, even where another copy of moe_gmm is installed.
_SRC = Path(__file__).resolve().parents[1] / "src"
if (_SRC / "moe_gmm").is_dir():
    sys.path.insert(0, str(_SRC))

import torch

from moe_gmm import grouped_matmul
from moe_gmm.bench.harness import Timing, timing_from_samples
from moe_gmm.bench.machine import describe_machine
from moe_gmm.ops import permute, swiglu, unpermute
from moe_gmm.ops.backends import get_backend
from moe_gmm.ops.gather_gmm import moe_mlp_gather_scatter
from moe_gmm.testing import (
    assert_rel_close,
    gmm_inputs,
    reference_grouped_matmul,
    reference_grouped_matmul_grads,
    tolerance_for,
)


@dataclass(frozen=True)
class MoeShape:
    name: str
    hidden: int
    intermediate: int
    local_experts: int
    top_k: int
    tokens: int

    @property
    def rows(self) -> int:
        return self.tokens * self.top_k

    def gemms(self) -> list[tuple[str, int, int]]:
        """(name, K, N) of the two expert GEMMs."""
        return [("gate_up", self.hidden, 2 * self.intermediate), ("down", self.intermediate, self.hidden)]


FULL_SHAPES = [
    MoeShape("qwen3.5-397b-ep16", 4096, 1024, 32, 10, tokens)
    for tokens in (4096, 16384)
] + [MoeShape("qwen3.5-35b", 2048, 512, 256, 8, tokens) for tokens in (4096, 16384)]  # fmt: skip
DRY_SHAPES = [MoeShape("tiny", 64, 32, 4, 2, 48)]

# Correctness cases: (counts, K, N, transposed weight). Empty experts, tails no tile divides.
FULL_CHECKS = [
    ([300, 0, 129, 1000, 7, 0], 1000, 776, False),
    ([513, 0, 64], 2048, 1024, True),
    ([0, 37, 0], 72, 48, False),
]
DRY_CHECKS = [([17, 0, 40, 3], 40, 24, True)]


def check_backend(backend: str, dtype: torch.dtype, counts, k, n, transposed, device) -> dict:
    x, w, group_list = gmm_inputs(counts, k, n, dtype, device=device, transposed_weight=transposed, seed=len(counts))
    x.requires_grad_(True)
    w.requires_grad_(True)
    y = grouped_matmul(x, w, group_list.to(device), backend=backend)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(y)
    y.backward(dy)
    limit = tolerance_for(dtype).rel
    ref_dx, ref_dw = reference_grouped_matmul_grads(x, w, counts, dy)
    record = {
        "backend": backend,
        "dtype": str(dtype).removeprefix("torch."),
        "counts": counts,
        "k": k,
        "n": n,
        "transposed": transposed,
    }
    assert_rel_close(y.cpu(), reference_grouped_matmul(x, w, counts), limit, f"{backend} {record} y")
    assert_rel_close(x.grad.cpu(), ref_dx, limit, f"{backend} {record} dx")
    assert_rel_close(w.grad.cpu(), ref_dw, limit, f"{backend} {record} dw")
    for e, c in enumerate(counts):
        if c == 0 and bool(w.grad[e].ne(0).any()):
            raise AssertionError(f"{backend} {record}: empty expert {e} has a non-zero grad_weight")
    return record


def check_no_host_sync() -> dict:
    """The triton forward and backward must not copy anything device-to-host (CUDA only)."""
    x, w, group_list = gmm_inputs([40, 0, 17, 64], 64, 48, torch.bfloat16, device="cuda")
    ends = torch.cumsum(group_list.cuda(), 0)
    x.requires_grad_(True)
    w.requires_grad_(True)
    dy = torch.randn(x.shape[0], 48, device="cuda", dtype=torch.bfloat16)
    grouped_matmul(x, w, ends, group_list_type="cumsum", backend="triton", validate=False)  # compile first
    torch.cuda.set_sync_debug_mode("error")
    try:
        grouped_matmul(x, w, ends, group_list_type="cumsum", backend="triton", validate=False).backward(dy)
    except RuntimeError as exc:
        raise AssertionError(f"triton forward/backward synchronised with the host: {exc}") from exc
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return {"backend": "triton", "check": "no host sync in forward and backward"}


def run_checks(device: str, dry_run: bool) -> list[dict]:
    cases = DRY_CHECKS if dry_run else FULL_CHECKS
    plan = [("triton", d) for d in (torch.float32, torch.float16, torch.bfloat16)] + [("torch", torch.bfloat16)]
    done = []
    for backend, dtype in plan:
        for counts, k, n, transposed in cases:
            x_probe, w_probe, _ = gmm_inputs([1], k, n, dtype, device=device)
            reason = get_backend(backend).refusal(x_probe, w_probe)
            if reason is not None:
                print(f"  skip {backend} {dtype} K={k} N={n}: {reason}")
                continue
            done.append(check_backend(backend, dtype, counts, k, n, transposed, device))
            print(f"  ok   {backend:6s} {dtype!s:15s} counts={counts} K={k} N={n} transposed={transposed}")
    if device == "cuda":
        done.append(check_no_host_sync())
        print("  ok   triton performs no host sync in forward and backward")
    return done


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def _timer(fn, device: str, warmup: int, repeats: int) -> Timing:
    """Median and spread of ``fn()``: CUDA events on a GPU (the launches are asynchronous), wall
    clock on CPU; summarised by the benchmark harness's ``timing_from_samples``."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    return timing_from_samples(samples)


def _uniform_counts(rows: int, experts: int, gen: torch.Generator) -> list[int]:
    ids = torch.randint(0, experts, (rows,), generator=gen)
    return torch.bincount(ids, minlength=experts).tolist()


def time_gemm(shape: MoeShape, gemm: str, k: int, n: int, device: str, dtype, warmup: int, repeats: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    counts = _uniform_counts(shape.rows, shape.local_experts, gen)
    x = (torch.randn(shape.rows, k, device=device) / 4).to(dtype).requires_grad_(True)
    w = (torch.randn(shape.local_experts, k, n, device=device) / k**0.5).to(dtype).requires_grad_(True)
    group_list = torch.tensor(counts, device=device)
    dy = torch.randn(shape.rows, n, device=device).to(dtype)
    w_dense = w[0].detach().clone().requires_grad_(True)
    flops_fwd = 2.0 * shape.rows * k * n

    def gmm_fn(backend: str, backward: bool):
        def run():
            y = grouped_matmul(x, w, group_list, backend=backend, validate=False)
            if backward:
                x.grad = w.grad = None
                y.backward(dy)

        return run

    def dense_fn(backward: bool):
        def run():
            y = torch.mm(x, w_dense)
            if backward:
                x.grad = w_dense.grad = None
                y.backward(dy)

        return run

    rows = []
    for mode, backward, flops in (("fwd", False, flops_fwd), ("fwd+bwd", True, 3 * flops_fwd)):
        impls = [("dense_mm", dense_fn(backward))]
        for backend in ("triton", "torch", "eager"):
            if get_backend(backend).refusal(x, w) is None:
                impls.append((backend, gmm_fn(backend, backward)))
        timings = {impl: _timer(fn, device, warmup, repeats) for impl, fn in impls}
        dense_ms = timings["dense_mm"].median_s * 1e3
        for impl, t in timings.items():
            ms = t.median_s * 1e3
            rows.append({
                "shape": shape.name, "tokens": shape.tokens, "rows": shape.rows, "experts": shape.local_experts,
                "gemm": gemm, "k": k, "n": n, "mode": mode, "impl": impl,
                "ms": ms, "p20_ms": t.p20_s * 1e3, "p80_ms": t.p80_s * 1e3,
                "tflops": flops / ms / 1e9, "frac_dense": dense_ms / ms,
            })  # fmt: skip
    return rows


def time_moe_mlp(shape: MoeShape, device: str, dtype, warmup: int, repeats: int) -> list[dict]:
    """Unfused (permute, GMM, swiglu, GMM, unpermute) vs the fused gather/scatter MLP: time, peak memory."""
    gen = torch.Generator().manual_seed(0)
    h, i, e = shape.hidden, shape.intermediate, shape.local_experts
    hidden = (torch.randn(shape.tokens, h, generator=gen) / 4).to(device, dtype).requires_grad_(True)
    ids = torch.stack([torch.randperm(e, generator=gen)[: shape.top_k] for _ in range(shape.tokens)]).to(device)
    probs = torch.softmax(torch.randn(shape.tokens, shape.top_k, generator=gen), -1).to(device, dtype)
    gate_up = (torch.randn(e, h, 2 * i, generator=gen) / h**0.5).to(device, dtype).requires_grad_(True)
    down = (torch.randn(e, i, h, generator=gen) / i**0.5).to(device, dtype).requires_grad_(True)

    def unfused(backend: str | None):
        def run():
            x_RH, row_id_map, counts = permute(hidden, ids, e, validate=False)
            a = swiglu(grouped_matmul(x_RH, gate_up, counts, backend=backend, validate=False))
            return unpermute(grouped_matmul(a, down, counts, backend=backend, validate=False), row_id_map, probs)

        return run

    def fused():
        return moe_mlp_gather_scatter(hidden, ids, probs, gate_up, down, validate=False)

    with torch.no_grad():
        out_u, out_f = unfused("triton")(), fused()
        limit = 2 * tolerance_for(dtype).rel
        assert_rel_close(out_f.float().cpu(), out_u.double().cpu(), limit, "fused vs unfused MoE MLP")
    del out_u, out_f
    rows = []
    # unfused_triton isolates the gather/scatter fusion (same GEMM kernels); unfused_auto is the default path.
    impls = (("unfused_triton", unfused("triton")), ("unfused_auto", unfused(None)), ("gather_scatter", fused))
    for impl, fn in impls:

        def step(fn=fn):
            hidden.grad = gate_up.grad = down.grad = None
            fn().float().square().mean().backward()

        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        ms = _timer(step, device, warmup, repeats).median_s * 1e3
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device == "cuda" else None
        rows.append(
            {
                "shape": shape.name,
                "tokens": shape.tokens,
                "impl": impl,
                "mode": "fwd+bwd",
                "ms": ms,
                "peak_extra_mib": peak,
            }
        )
    return rows


def _machine(device: str) -> dict:
    info = asdict(describe_machine())
    info["device"] = device
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    return info


def _print_table(rows: list[dict]) -> None:
    header = (
        f"{'shape':20s} {'tok':>6s} {'gemm':8s} {'K':>5s} {'N':>5s} {'mode':8s} {'impl':9s} "
        f"{'ms':>9s} {'TFLOP/s':>8s} {'x dense':>7s}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['shape']:20s} {r['tokens']:6d} {r['gemm']:8s} {r['k']:5d} {r['n']:5d} {r['mode']:8s} {r['impl']:9s} "
              f"{r['ms']:9.3f} {r['tflops']:8.2f} {r['frac_dense']:7.3f}")  # fmt: skip


def run_timings(result: dict, shapes, device: str, dry_run: bool, warmup: int, repeats: int, started: float) -> None:
    dtype = torch.float32 if dry_run else torch.bfloat16  # the interpreter's bf16 dot is emulated
    for shape in shapes:
        for gemm, k, n in shape.gemms():
            result["gemm"].extend(time_gemm(shape, gemm, k, n, device, dtype, warmup, repeats))
        result["moe_mlp"].extend(time_moe_mlp(shape, device, dtype, warmup, repeats))
        print(f"  timed {shape.name} tokens={shape.tokens} ({time.perf_counter() - started:.0f} s)")
    _print_table(result["gemm"])
    for r in result["moe_mlp"]:
        peak = "n/a" if r["peak_extra_mib"] is None else f"{r['peak_extra_mib']:.0f} MiB"
        print(f"moe_mlp fwd+bwd {r['shape']} tokens={r['tokens']} {r['impl']:15s} {r['ms']:9.3f} ms  "
              f"peak memory above inputs {peak}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out", type=Path, default=Path("out/gpu_check.json"), help="where to write the JSON results"
    )
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per measurement")
    parser.add_argument("--skip-timing", action="store_true", help="correctness only")
    args = parser.parse_args(argv)

    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # in case main() is called in-process
        device, shapes, warmup, repeats = "cpu", DRY_SHAPES, 0, args.repeats or 1
    else:
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device (use --dry-run to exercise the script on CPU)", file=sys.stderr)
            return 2
        device, shapes, warmup, repeats = "cuda", FULL_SHAPES, 3, args.repeats or 10
    started = time.perf_counter()
    result = {"machine": _machine(device), "dry_run": args.dry_run, "checks": [], "gemm": [], "moe_mlp": []}
    m = result["machine"]
    print(f"gpu_check on {m.get('gpu', m['cpu_model'])}: torch {m['torch_version']}, triton {m['triton']}, "
          f"commit {m['git_commit']}")  # fmt: skip
    print("correctness:")
    try:
        result["checks"] = run_checks(device, args.dry_run)
        if not args.skip_timing:
            run_timings(result, shapes, device, args.dry_run, warmup, repeats, started)
    except AssertionError as exc:
        print(f"CORRECTNESS FAILURE: {exc}", file=sys.stderr)
        result["failure"] = str(exc)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1, default=str))
        return 1
    result["seconds"] = time.perf_counter() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {args.out} in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
