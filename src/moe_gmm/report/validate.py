"""``moe-gmm validate``: fill the measurement table, eager and fused side by side, with a fixed seed.

Sections, in order:

1. grouped matmul: forward, grad_input and per-expert grad_weight for uniform, uneven and
   empty-expert group lists, each path against the float64 reference and fused against eager;
2. routed experts and the MoE block (see :mod:`moe_gmm.report.layer_checks`): the routed-expert
   output with the shared expert held fixed, grad_input, grad_weight per expert, routing and
   shape checks;
3. the Hugging Face Qwen3.5-MoE block with ``experts_implementation="moe_gmm"`` against
   transformers' own eager experts (see :mod:`moe_gmm.report.hf_checks`);
4. performance (see :mod:`moe_gmm.report.perf_checks`): the two expert matmuls, permute/unpermute,
   host time and one training step of the MoE block, eager vs fused.

Legend: T tokens, k top-k, E experts, H hidden, I moe intermediate, M = T*k permuted rows.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moe_gmm._validation import check_fits_in_memory, writable_directory
from moe_gmm.config import MAX_SEED, ModelConfig
from moe_gmm.ops import grouped_matmul
from moe_gmm.ops.backends import get_backend, select_backend
from moe_gmm.report.checks import (
    allclose_row,
    dtype_name,
    empty_zero_row,
    per_expert_max_abs,
    per_expert_row,
    rel_err_row,
)
from moe_gmm.report.model import Report
from moe_gmm.testing import (
    gmm_inputs,
    group_counts,
    reference_grouped_matmul,
    reference_grouped_matmul_grads,
    tolerance_for,
)

__all__ = ["DTYPES", "MODEL_PRESETS", "ValidateOptions", "ValidationUsageError", "run_validation"]

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

# Layer sizes to validate at. ``tiny`` is the default model (the dataclass defaults); the others are
# one MoE layer of the published Qwen3.5-MoE models (35B-A3B: H=2048, E=256, k=8, I=512;
# 397B-A17B: H=4096, E=512, k=10, I=1024).
MODEL_PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(),
    "qwen3_5_35b_layer": ModelConfig(
        hidden_size=2048,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
    ),
    "qwen3_5_397b_layer": ModelConfig(
        hidden_size=4096,
        num_experts=512,
        num_experts_per_tok=10,
        moe_intermediate_size=1024,
        shared_expert_intermediate_size=1024,
    ),
}
GMM_ROUTINGS = ("uniform", "uneven", "empty")


class ValidationUsageError(ValueError):
    """The options cannot run here (unknown backend, missing device...): a usage error, exit code 2."""


@dataclass
class ValidateOptions:
    device: str = "cpu"
    dtype: str = "bf16"
    model: str = "tiny"
    quick: bool = False
    backend: str | None = None  # the fused path's grouped-matmul backend; None = automatic
    seed: int = 0
    num_tokens: int | None = None  # None: 64 (quick) / 256 tokens
    plots: bool = True

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def tokens(self) -> int:
        return self.num_tokens if self.num_tokens is not None else (64 if self.quick else 256)


def _check_options(opts: ValidateOptions) -> torch.device:
    if opts.dtype not in DTYPES:
        raise ValidationUsageError(f"--dtype must be one of {sorted(DTYPES)}, got {opts.dtype!r}")
    if opts.model not in MODEL_PRESETS:
        raise ValidationUsageError(f"--model must be one of {sorted(MODEL_PRESETS)}, got {opts.model!r}")
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise ValidationUsageError("--device cuda: torch.cuda.is_available() is False in this environment")
    if opts.device == "npu":
        try:
            import torch_npu  # noqa: F401
        except ImportError:
            raise ValidationUsageError("--device npu: torch_npu is not installed") from None
    if opts.device not in ("cpu", "cuda", "npu"):
        raise ValidationUsageError(f"--device must be cpu, cuda or npu, got {opts.device!r}")
    if isinstance(opts.seed, bool) or not isinstance(opts.seed, int) or not 0 <= opts.seed <= MAX_SEED:
        raise ValidationUsageError(f"--seed must be an int in [0, {MAX_SEED}], got {opts.seed!r}")
    if isinstance(opts.tokens, bool) or not isinstance(opts.tokens, int) or opts.tokens < 1:
        raise ValidationUsageError(f"--tokens must be an int >= 1, got {opts.tokens!r}")
    try:
        check_fits_in_memory(_least_bytes(opts), opts.device, f"--tokens {opts.tokens} with --model {opts.model}")
    except ValueError as exc:
        raise ValidationUsageError(str(exc)) from None
    device = torch.device(opts.device)
    try:
        if opts.backend is not None:
            get_backend(opts.backend)
        _fused_backend_names(opts, device, MODEL_PRESETS[opts.model])
    except ValueError as exc:
        # Without --backend the choice is $MOE_GMM_BACKEND's, whose errors name it, or automatic.
        message = f"--backend {opts.backend}: {exc}" if opts.backend is not None else str(exc)
        raise ValidationUsageError(message) from None
    return device


def _least_bytes(opts: ValidateOptions) -> int:
    """A lower bound on the memory the grouped-matmul section needs: the permuted rows ``[T*k, H]`` and
    their ``[T*k, 2I]`` products, each in the run's dtype and as a float64 reference."""
    shape = MODEL_PRESETS[opts.model]
    rows = opts.tokens * shape.num_experts_per_tok
    return rows * (shape.hidden_size + 2 * shape.moe_intermediate_size) * (8 + opts.torch_dtype.itemsize)


def _fused_backend_names(opts: ValidateOptions, device: torch.device, shape: ModelConfig) -> str:
    """The backend(s) the fused path picks for the gate_up ([H, 2I]) and down ([I, H]) matmuls."""
    names = []
    for k_dim, n_dim in (
        (shape.hidden_size, 2 * shape.moe_intermediate_size),
        (shape.moe_intermediate_size, shape.hidden_size),
    ):
        x = torch.empty(1, k_dim, dtype=opts.torch_dtype, device=device)
        w = torch.empty(1, k_dim, n_dim, dtype=opts.torch_dtype, device=device)
        name = select_backend(x, w, opts.backend).name
        if name not in names:
            names.append(name)
    return "/".join(names)


# ----------------------------------------------------------------------------------------------
# Section 1: the grouped matmul on its own
# ----------------------------------------------------------------------------------------------


def _run_gmm(x, w, counts, dy, fused: bool, backend: str | None):
    x = x.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    y = grouped_matmul(x, w, counts, fused=fused, backend=backend if fused else None)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def gmm_rows(report: Report, opts: ValidateOptions, device: torch.device, shape: ModelConfig) -> dict[str, Any]:
    """Rows for the grouped matmul alone; returns per-expert data for the plots."""
    dtype, tol = opts.torch_dtype, tolerance_for(opts.torch_dtype)
    num_rows = opts.tokens * shape.num_experts_per_tok
    k_dim, n_dim = shape.hidden_size, 2 * shape.moe_intermediate_size
    section = f"grouped matmul (M={num_rows}, K={k_dim}, N={n_dim}, E={shape.num_experts})"
    plot_data: dict[str, Any] = {}
    for case_index, routing in enumerate(GMM_ROUTINGS):
        g = torch.Generator().manual_seed(opts.seed + case_index)
        counts = group_counts(num_rows, shape.num_experts, routing, generator=g)
        # The uneven case also reads the weight through a transposed view (the HF layout).
        x, w, group_list = gmm_inputs(
            counts,
            k_dim,
            n_dim,
            dtype,
            device=device,
            transposed_weight=routing == "uneven",
            seed=opts.seed + 10 + case_index,
        )
        dy = torch.randn(num_rows, n_dim, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
        y_e, dx_e, dw_e = _run_gmm(x, w, group_list, dy, fused=False, backend=None)
        y_f, dx_f, dw_f = _run_gmm(x, w, group_list, dy, fused=True, backend=opts.backend)
        y_ref = reference_grouped_matmul(x, w, counts)
        dx_ref, dw_ref = reference_grouped_matmul_grads(x, w, counts, dy)
        empty = [e for e, c in enumerate(counts) if c == 0]
        nonzero = [c for c in counts if c > 0]
        case = f"{routing} groups"
        note = f"rows/expert min {min(nonzero)} max {max(nonzero)}, {len(empty)} empty"
        if routing == "uneven":
            note += ", weight as transposed view"
        report.add(rel_err_row(section, f"forward, {case}", y_e, y_f, y_ref, tol, note))
        report.add(allclose_row(section, f"forward, {case}", y_e, y_f, tol))
        report.add(rel_err_row(section, f"grad_input, {case}", dx_e, dx_f, dx_ref, tol))
        report.add(allclose_row(section, f"grad_input, {case}", dx_e, dx_f, tol))
        report.add(rel_err_row(section, f"grad_weight, {case}", dw_e, dw_f, dw_ref, tol))
        report.add(per_expert_row(section, f"grad_weight per expert, {case}", dw_e, dw_f, counts, tol))
        if empty:
            report.add(empty_zero_row(section, f"grad_weight of empty experts, {case}", dw_e, dw_f, empty))
        plot_data[routing] = {"counts": counts, "grad_weight": per_expert_max_abs(dw_f, dw_e)}
    return plot_data


# ----------------------------------------------------------------------------------------------
# Orchestration
# ----------------------------------------------------------------------------------------------


def run_validation(opts: ValidateOptions, out_dir: str | Path | None = None, progress=None) -> tuple[Report, dict]:
    """Fill the table. Returns the report and ``{name: path}`` of the files written (if ``out_dir``).

    ``progress``, if given, is called as ``progress(description)`` before each section.
    """
    from moe_gmm.report import hf_checks, layer_checks, perf_checks

    device = _check_options(opts)
    if out_dir is not None:  # before the minutes of work, not after
        try:
            writable_directory(out_dir, "--out")
        except ValueError as exc:
            raise ValidationUsageError(str(exc)) from None
    shape = MODEL_PRESETS[opts.model]
    torch.manual_seed(opts.seed)
    fused_backend = _fused_backend_names(opts, device, shape)
    report = Report(
        title="moe-gmm validate: eager vs fused",
        meta={
            "device": opts.device,
            "dtype": dtype_name(opts.torch_dtype),
            "model": opts.model,
            "tokens": opts.tokens,
            "E": shape.num_experts,
            "top_k": shape.num_experts_per_tok,
            "H": shape.hidden_size,
            "I": shape.moe_intermediate_size,
            "fused_backend": fused_backend,
            "seed": opts.seed,
            "quick": opts.quick,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
    )
    say = progress or (lambda _msg: None)
    say("grouped matmul")
    gmm_plot = gmm_rows(report, opts, device, shape)
    say("routed experts and MoE block")
    layer_plot = layer_checks.layer_rows(report, opts, device, shape)
    gmm_diffs = [r.fused for r in report.rows if r.metric.startswith("max abs diff fused-eager")]
    if gmm_diffs and all(d == 0.0 for d in gmm_diffs):
        report.notes.append(
            f"The fused backend ({fused_backend}) agrees with the eager loop bitwise at these sizes. That is an "
            "observation, not the contract: the backend runs kernels of its own (the cpu backend: native kernels "
            "or one library GEMM per expert), so other sizes or backends may differ within the tolerance above "
            "(e.g. --backend triton with TRITON_INTERPRET=1)."
        )
    say("Hugging Face Qwen3.5-MoE block")
    hf_checks.hf_rows(report, opts, device, shape)
    say("timing")
    times = perf_checks.timing_rows(report, opts, device, shape)
    files: dict[str, Path] = {}
    if out_dir is not None:
        from moe_gmm.report.render import write_report

        files.update(write_report(report, out_dir))
        if opts.plots:
            files.update(_write_plots(Path(out_dir), gmm_plot, layer_plot, times, tolerance_for(opts.torch_dtype)))
    return report, files


def _write_plots(out: Path, gmm_plot: dict, layer_plot: dict, times: dict, tol) -> dict[str, Path]:
    if importlib.util.find_spec("matplotlib") is None:  # pragma: no cover - the optional "plot" extra
        return {}
    from moe_gmm.report import plots

    files = {}
    if layer_plot.get("grad_weight"):
        series, counts = layer_plot["grad_weight"], layer_plot["counts"]
    else:
        series, counts = {"gmm, empty groups": gmm_plot["empty"]["grad_weight"]}, gmm_plot["empty"]["counts"]
    files["grad_weight_per_expert"] = plots.plot_grad_weight_errors(
        series, counts, tol.atol, out / "grad_weight_per_expert.png"
    )
    if times:
        files["time_breakdown"] = plots.plot_time_breakdown(times, out / "time_breakdown.png")
    if layer_plot.get("router_counts") is not None:
        files["tokens_per_expert"] = plots.plot_tokens_per_expert(
            layer_plot["router_counts"], out / "tokens_per_expert.png", "tokens per expert (router of the MoE block)"
        )
    return files
