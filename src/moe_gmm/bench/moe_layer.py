"""MoE-layer benchmark: one Qwen3.5-MoE sparse block, moe-gmm's vs transformers', side by side.

Legend: T tokens, k top-k, E experts, H hidden, I moe intermediate, Is shared-expert intermediate.

Implementations, all on the same weights and the same input ``x [1, T, H]``:

- ``hf_eager``: transformers' ``Qwen3_5MoeSparseMoeBlock``, experts_implementation ``eager`` (its
  per-expert loop); the reference every other row is compared with;
- ``hf_grouped_mm``: the same block with transformers' ``grouped_mm`` experts;
- ``hf_moe_gmm``: the same block with experts_implementation ``moe_gmm`` (our integration);
- ``hf_moe_gmm_padded``: ``hf_moe_gmm`` after ``pad_expert_weight_rows`` (opt-in; a copy made once);
- ``hf_moe_gmm_input_major``: ``hf_moe_gmm`` after ``store_expert_weights_input_major`` (opt-in; a
  copy made once);
- ``moe_gmm``: :class:`~moe_gmm.layers.SparseMoeBlock` (fused, auto backend), weights converted
  once to its ``[E, H, 2I]`` / ``[E, I, H]`` layout;
- ``moe_gmm_eager``: the same block with ``use_grouped_expert_matmul=False`` (opt-in);
- ``moe_gmm_padded``: ``moe_gmm`` with its expert weights stored with padded rows, as
  ``MoeBlockConfig(pad_expert_weight_rows=True)`` lays them out (opt-in; a copy made once).

The headline mode, ``train`` (printed first), times the step training runs: ``zero_grad``, forward,
``loss.backward()``, AdamW's step, over this block and small causal LMs (:mod:`moe_gmm.bench.train_step`).
The modes below time ``torch.autograd.grad``, which never accumulates into ``.grad``.

Gradients are taken for ``x`` and every parameter. ``moe_gmm``'s expert weights are handed to the
harness as Hugging Face-layout transposed *views* of its own parameters, so its gradients compare
element by element with transformers' while the block still reads its own memory layout.

Work per mode (``s`` bytes per element, ``R = T k``):

- FLOPs fwd ``2THE`` (router) + ``6RHI`` (experts) + ``6THIs + 2TH`` (shared expert and gate);
  bwd twice that; fwdbwd three times.
- minimal bytes: fwd ``s(P + 2TH)`` (P = all parameters, x read, out written); bwd
  ``s(2P + 3TH)`` (parameters read, their grads written, x and dy read, dx written); fwdbwd the sum.

:func:`profile_breakdown` times ``moe_gmm``'s phases with ``torch.profiler`` from the
``record_function`` labels in the layer: ``moe::router``, ``moe::permute``, ``moe::gmm``,
``moe::swiglu``, ``moe::unpermute``, ``moe::shared_expert`` (forward), ``moe::*_bwd`` and the
grouped matmul's grad ops (backward); it reports the median of ``--breakdown-steps`` profiled steps.

``--memory`` also reports, per case x dtype x implementation, the resident peak of one fwd+bwd step
against its budget (weights + grads + ``x`` and ``dx`` + the activations autograd saves), each
measured in a fresh process; the definitions are in :mod:`moe_gmm.bench.memory`.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import shlex
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from moe_gmm.bench.harness import (
    Impl,
    TimingSettings,
    Workload,
    add_run_arguments,
    case_rate_note,
    maybe_progress,
    run_benchmark,
    split_choices,
    time_interleaved,
)
from moe_gmm.bench.machine import DTYPE_NAMES, describe_machine, gemm_rate_probes, measure_limits
from moe_gmm.bench.memory import measure_in_subprocess, memory_markdown, print_memory_table
from moe_gmm.integrations.transformers import (
    hf_to_moe_gmm_state_dict,
    moe_block_config_from_hf,
    pad_expert_weight_rows,
    register_moe_gmm_experts,
    store_expert_weights_input_major,
)
from moe_gmm.layers import SparseMoeBlock
from moe_gmm.ops.weight_layout import pad_rows

__all__ = [
    "CASE_SETS",
    "IMPLS",
    "MoeLayerCase",
    "case_set",
    "layer_impls",
    "main",
    "measure_memory",
    "profile_breakdown",
    "time_glue_alone",
]

IMPLS = (
    "hf_eager",
    "hf_grouped_mm",
    "hf_moe_gmm",
    "hf_moe_gmm_padded",
    "hf_moe_gmm_input_major",
    "moe_gmm",
    "moe_gmm_eager",
    "moe_gmm_padded",
)
DEFAULT_IMPLS = ("hf_eager", "hf_grouped_mm", "hf_moe_gmm", "moe_gmm")
_HF_IMPL = {
    "hf_eager": "eager",
    "hf_grouped_mm": "grouped_mm",
    "hf_moe_gmm": "moe_gmm",
    "hf_moe_gmm_padded": "moe_gmm",
    "hf_moe_gmm_input_major": "moe_gmm",
}
# What each opt-in Hugging Face variant does to its block's expert weights once, before the steps.
_HF_RELAYOUT = {
    "hf_moe_gmm_padded": (pad_expert_weight_rows, "padded expert rows"),
    "hf_moe_gmm_input_major": (store_expert_weights_input_major, "expert weights stored input-major"),
}
_MODE_FACTOR = {"fwd": 1, "bwd": 2, "fwdbwd": 3}
# moe-gmm parameters stored transposed relative to transformers' (see the module docstring).
_TRANSPOSED = ("experts.gate_up_proj", "experts.down_proj")


@dataclass
class MoeLayerInputs:
    """The transformers block (the weights' owner), our block (a converted copy) and ``x [1, T, H]``."""

    hf_config: Any
    hf_block: torch.nn.Module
    block: SparseMoeBlock
    x: torch.Tensor


@dataclass(frozen=True)
class MoeLayerCase:
    """One sparse MoE block of Qwen3.5-like proportions on T tokens (uniform random weights)."""

    num_experts: int
    num_tokens: int
    top_k: int = 8
    hidden: int = 2048
    intermediate: int = 512
    shared_intermediate: int = 512

    @property
    def name(self) -> str:
        return f"E{self.num_experts}-k{self.top_k}-T{self.num_tokens}"

    def columns(self) -> dict[str, str]:
        return {"shape": f"H{self.hidden} I{self.intermediate} Is{self.shared_intermediate}"}

    def params(self) -> dict[str, Any]:
        return {
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "num_tokens": self.num_tokens,
            "hidden": self.hidden,
            "intermediate": self.intermediate,
            "shared_intermediate": self.shared_intermediate,
        }

    def hf_config(self):
        from transformers import Qwen3_5MoeTextConfig

        return Qwen3_5MoeTextConfig(
            hidden_size=self.hidden,
            num_experts=self.num_experts,
            num_experts_per_tok=self.top_k,
            moe_intermediate_size=self.intermediate,
            shared_expert_intermediate_size=self.shared_intermediate,
        )

    def make_inputs(self, dtype: torch.dtype) -> MoeLayerInputs:
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

        cfg = self.hf_config()
        cfg._experts_implementation = "eager"
        hf_block = Qwen3_5MoeSparseMoeBlock(cfg)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in hf_block.parameters():
                # nn.Linear-like scale 1/sqrt(fan_in); fan_in is the last dim in transformers' layouts.
                p.copy_((torch.rand(p.shape, generator=g) * 2 - 1) * p.shape[-1] ** -0.5)
        hf_block = hf_block.to(dtype)
        # No aux loss in the timed block: transformers computes it at the model level, not in the block.
        block = SparseMoeBlock(moe_block_config_from_hf(cfg, router_aux_loss_coef=0.0)).to(dtype)
        block.load_state_dict(hf_to_moe_gmm_state_dict(hf_block.state_dict()))
        x = torch.randn(1, self.num_tokens, self.hidden, generator=g).to(dtype).requires_grad_(True)
        return MoeLayerInputs(hf_config=cfg, hf_block=hf_block, block=block, x=x)

    def _param_numel(self) -> int:
        h, e, i, si = self.hidden, self.num_experts, self.intermediate, self.shared_intermediate
        return e * h + e * 3 * h * i + 3 * h * si + h

    def flops(self, mode: str) -> float:
        t, h, e, i, si = self.num_tokens, self.hidden, self.num_experts, self.intermediate, self.shared_intermediate
        fwd = 2.0 * t * h * e + 6.0 * t * self.top_k * h * i + 6.0 * t * h * si + 2.0 * t * h
        return fwd * _MODE_FACTOR[mode]

    def min_bytes(self, mode: str, dtype: torch.dtype) -> float:
        size = torch.empty((), dtype=dtype).element_size()
        p, act = self._param_numel(), self.num_tokens * self.hidden
        fwd, bwd = p + 2 * act, 2 * p + 3 * act
        return float(size * {"fwd": fwd, "bwd": bwd, "fwdbwd": fwd + bwd}[mode])


def _hf_impl(name: str) -> Impl:
    implementation = _HF_IMPL[name]

    def prepare(inp: MoeLayerInputs) -> Workload:
        # A second module sharing the weights' storage, with its own config: the experts read
        # config._experts_implementation at every call, so each implementation needs its own.
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

        cfg = copy.deepcopy(inp.hf_config)
        cfg._experts_implementation = implementation
        with torch.device("meta"):
            hf_block = Qwen3_5MoeSparseMoeBlock(cfg)
        hf_block.load_state_dict(inp.hf_block.state_dict(), assign=True)
        if name in _HF_RELAYOUT:  # this block's expert weights copied once into another layout
            _HF_RELAYOUT[name][0](hf_block)
        leaves = (inp.x, *hf_block.parameters())
        return Workload(forward=lambda: hf_block(inp.x), leaves=leaves)

    return Impl(
        name=name,
        prepare=prepare,
        description=f"transformers Qwen3_5MoeSparseMoeBlock, {implementation} experts"
        + (f", {_HF_RELAYOUT[name][1]}" if name in _HF_RELAYOUT else ""),
    )


def _ours_impl(name: str) -> Impl:
    fused = name != "moe_gmm_eager"
    padded = name == "moe_gmm_padded"

    def prepare(inp: MoeLayerInputs) -> Workload:
        # A parameter-less twin with this implementation's switch; it runs on inp.block's tensors.
        with torch.device("meta"):
            block = SparseMoeBlock(dataclasses.replace(inp.block.config, use_grouped_expert_matmul=fused))
        ours = dict(inp.block.named_parameters())
        if padded:  # the expert weights copied once into padded rows (same values)
            ours.update({n: pad_rows(ours[n]).requires_grad_() for n in _TRANSPOSED})
        # Leaves in transformers' order and layout: transposed views of our parameters (no copy).
        exposed = {n: (ours[n].transpose(1, 2) if n in _TRANSPOSED else ours[n]) for n in ours}
        used = {n: (exposed[n].transpose(1, 2) if n in _TRANSPOSED else exposed[n]) for n in ours}
        order = [n for n, _ in inp.hf_block.named_parameters()]

        def forward():
            return torch.func.functional_call(block, used, (inp.x,))

        return Workload(forward=forward, leaves=(inp.x, *(exposed[n] for n in order)))

    return Impl(
        name=name,
        prepare=prepare,
        description="moe_gmm SparseMoeBlock, "
        + ("eager loop" if not fused else "grouped_matmul (auto backend)" + (", padded expert rows" if padded else "")),
    )


def layer_impls(names: list[str] | None = None, reference: str = "hf_eager") -> list[Impl]:
    """The requested implementations and the ``reference`` (``hf_eager`` unless told otherwise)."""
    names = list(names or DEFAULT_IMPLS)
    unknown = [n for n in (*names, reference) if n not in IMPLS]
    if unknown:
        raise ValueError(f"--impls/--reference: unknown {unknown}; choose from {list(IMPLS)}")
    if reference not in names:
        names.insert(0, reference)
    if any(_HF_IMPL.get(n) == "moe_gmm" for n in names):
        register_moe_gmm_experts()
    return [_hf_impl(n) if n in _HF_IMPL else _ours_impl(n) for n in IMPLS if n in names]


def case_set(name: str) -> list[MoeLayerCase]:
    """``tiny``: a smoke test; ``quick``: a scaled-down block (under a minute on two cores);
    ``qwen``: Qwen3.5-MoE proportions (hidden 2048, intermediate 512, top-8, E 64/256, T 1024/4096);
    ``cpu``: E 8 (top-2) and 64 (top-8) sized for two cores; ``experts``: E 8 (top-2) and 64/128/256
    (top-8) at H1024 I256 T512."""
    if name == "tiny":
        return [MoeLayerCase(num_experts=4, num_tokens=8, top_k=2, hidden=16, intermediate=8, shared_intermediate=8)]
    if name == "quick":
        return [MoeLayerCase(num_experts=32, num_tokens=256, hidden=512, intermediate=128, shared_intermediate=128)]
    if name == "qwen":
        return [MoeLayerCase(num_experts=e, num_tokens=t) for e in (64, 256) for t in (1024, 4096)]
    if name == "experts":
        # E 8..256 at one shape (2-core sized): with --reference hf_grouped_mm, since hf_eager's
        # backward takes minutes per step at E=256.
        return [
            MoeLayerCase(
                num_experts=e,
                num_tokens=512,
                top_k=2 if e == 8 else 8,
                hidden=1024,
                intermediate=256,
                shared_intermediate=256,
            )
            for e in (8, 64, 128, 256)
        ]
    if name == "cpu":
        # Sized for a 2-core CPU, where hf_eager's O(E^2) backward bounds what can run (E <= 64).
        return [
            MoeLayerCase(
                num_experts=8, num_tokens=1024, top_k=2, hidden=1024, intermediate=512, shared_intermediate=512
            ),
            MoeLayerCase(
                num_experts=64, num_tokens=512, top_k=8, hidden=1024, intermediate=256, shared_intermediate=256
            ),
        ]
    raise ValueError(f"case set must be one of {CASE_SETS}, got {name!r}")


CASE_SETS = ("tiny", "quick", "qwen", "cpu", "experts")

# Forward phases are the layer's own labels; backward phases are our autograd labels and the
# grouped matmul's grad ops (each custom op is one profiler event).
_FWD_PHASES = {
    "moe::router": "router",
    "moe::permute": "permute",
    "moe::gmm": "gmm",
    "moe::swiglu": "swiglu",
    "moe::unpermute": "unpermute",
    "moe::shared_expert": "shared_expert",
}
_BWD_PHASES = {
    "moe::permute_bwd": "permute",
    "moe_gmm::grouped_matmul_grad_input": "gmm",
    "moe_gmm::grouped_matmul_grad_weight": "gmm",
    "moe::swiglu_bwd": "swiglu",
    "moe::unpermute_bwd": "unpermute",
}
PHASES = ("router", "permute", "gmm", "swiglu", "unpermute", "shared_expert", "other")


def _phases_of(prof) -> dict[str, dict[str, float]]:
    """One profiled step's milliseconds by phase."""
    totals = {e.key: e.cpu_time_total / 1e3 for e in prof.key_averages()}
    out: dict[str, dict[str, float]] = {
        "fwd": dict.fromkeys(PHASES, 0.0),
        "bwd": dict.fromkeys((p for p in PHASES if p not in ("router", "shared_expert")), 0.0),
    }
    for key, phase in _FWD_PHASES.items():
        out["fwd"][phase] += totals.get(key, 0.0)
    for key, phase in _BWD_PHASES.items():
        out["bwd"][phase] += totals.get(key, 0.0)
    for direction, label in (("fwd", "moe::step_fwd"), ("bwd", "moe::step_bwd")):
        labelled = sum(out[direction].values())
        out[direction]["other"] = max(totals.get(label, 0.0) - labelled, 0.0)
        out[direction]["total"] = totals.get(label, 0.0)
    return out


def _block_step(case: MoeLayerCase, dtype: torch.dtype):
    """``moe_gmm``'s block for ``case``, its input, an upstream gradient and one labelled fwd+bwd step."""
    inp = case.make_inputs(dtype)
    block, x = inp.block, inp.x
    params = [x, *block.parameters()]
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype)

    def step():
        with record_function("moe::step_fwd"):
            out = block(x)
        with record_function("moe::step_bwd"):
            return torch.autograd.grad(out, params, dy)

    return block, x, dy, step


def profile_breakdown(case: MoeLayerCase, dtype: torch.dtype, *, steps: int = 3) -> dict[str, dict[str, float]]:
    """Milliseconds of ``moe_gmm``'s forward and backward by phase, in the median of ``steps`` steps.

    Each step is profiled on its own; the result is the step whose fwd+bwd total is the median (the
    lower of the two middle ones for an even count), whole, so its phases add up to its total. One
    step disturbed by the machine (a shared VM's steps vary by several ms) then moves no phase.
    ``other`` is the rest of the labelled step: in the forward the residual add and reshapes, in
    the backward the router's and the shared expert's autograd (plain ``nn.Linear`` ops, not
    labelled individually, so ``bwd`` has no ``router``/``shared_expert`` entries) and gradient
    bookkeeping. One warm-up step runs outside the profile. The profiler's cost per op is in every
    phase, most in those of many short ops (permute, unpermute).
    """
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise TypeError(f"steps must be an int, got {type(steps).__name__}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    _, _, _, step = _block_step(case, dtype)
    step()
    results = []
    for _ in range(steps):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        results.append(_phases_of(prof))
    results.sort(key=lambda r: r["fwd"]["total"] + r["bwd"]["total"])
    return results[(steps - 1) // 2]


def time_glue_alone(case: MoeLayerCase, dtype: torch.dtype, settings: TimingSettings | None = None) -> dict[str, float]:
    """permute + unpermute forward and backward timed without the profiler, against the layer's step.

    The profiler's cost per op inflates the phases of many short ops (:func:`profile_breakdown`),
    so the glue's share is also measured this way: ``moe_gmm``'s block runs fwd+bwd, and
    ``permute`` of the same input with the block's own routing followed by ``unpermute`` of the
    permuted rows (standing in for the experts' output, same shape) runs fwd+bwd into the input and
    the routing weights; the two are timed in interleaved rounds (medians), so the glue starts
    where a step left the caches and the thread pool, as in training. Neither measure is exact:
    the profiled share carries the profiler's cost per op; this one times the glue's ops apart
    from the phases that warm its inputs in the layer. Returns ``glue_ms``, ``step_ms`` and
    ``share``.
    """
    from moe_gmm.ops.permute import permute, unpermute

    settings = settings or TimingSettings(warmup=2, min_repeats=10, max_repeats=60, min_seconds=1.0)
    block, x, dy, step = _block_step(case, dtype)
    x_TH = x.detach().reshape(-1, case.hidden).clone().requires_grad_(True)
    with torch.no_grad():
        _, weights_Tk, indices_Tk = block.gate(x_TH)
    weights_Tk = weights_Tk.detach().clone().requires_grad_(True)
    dy_TH = dy.reshape(-1, case.hidden)

    def glue():
        permuted_RH, row_id_map_R, _ = permute(x_TH, indices_Tk, case.num_experts)
        out_TH = unpermute(permuted_RH, row_id_map_R, weights_Tk)
        return torch.autograd.grad(out_TH, (x_TH, weights_Tk), dy_TH)

    timings = time_interleaved({"step": step, "glue": glue}, settings)
    step_ms, glue_ms = timings["step"].median_s * 1e3, timings["glue"].median_s * 1e3
    return {"glue_ms": glue_ms, "step_ms": step_ms, "share": glue_ms / step_ms}


def _glue_line(glue: dict[str, float]) -> str:
    return (
        f"permute + unpermute fwd+bwd timed alone, without the profiler: {glue['glue_ms']:.2f} ms, "
        f"{glue['share']:.1%} of the step's {glue['step_ms']:.1f} ms (medians, interleaved)"
    )


def _print_breakdown(console, case: MoeLayerCase, dtype: torch.dtype, result: dict[str, dict[str, float]]) -> None:
    from rich.table import Table

    table = Table(title=f"moe_gmm SparseMoeBlock time by phase, {case.name} {DTYPE_NAMES[dtype]} (ms per step)")
    for col in ("phase", "fwd ms", "bwd ms", "fwd+bwd ms", "share"):
        table.add_column(col, justify="left" if col == "phase" else "right")
    total = result["fwd"]["total"] + result["bwd"]["total"]
    for phase in PHASES:
        f, b = result["fwd"][phase], result["bwd"].get(phase)
        both = f + (b or 0.0)
        label = "other (bwd: + router, shared expert)" if phase == "other" else phase
        b_text = "in other" if b is None else f"{b:.2f}"
        table.add_row(label, f"{f:.2f}", b_text, f"{both:.2f}", f"{both / total:.0%}" if total else "-")
    table.add_row("total", f"{result['fwd']['total']:.2f}", f"{result['bwd']['total']:.2f}", f"{total:.2f}", "100%")
    console.print(table)


def measure_memory(
    cases: list[MoeLayerCase], dtypes: list[torch.dtype], impl_names: list[str], *, console=None
) -> list[dict[str, Any]]:
    """Peak memory vs budget per case x dtype x impl, each in a fresh process with this process's threads.

    Prints the table when ``console`` is given. A failed measurement becomes a row with ``error``.
    """
    records = []
    for case in cases:
        for dtype in dtypes:
            for name in impl_names:
                head = {"case": case.name, "dtype": DTYPE_NAMES[dtype], "impl": name}
                if console is not None:
                    console.print(f"memory: {case.name} {head['dtype']} {name} (fresh process)...", highlight=False)
                spec = {"case": case.params(), "dtype": head["dtype"], "impl": name}
                try:
                    records.append({**head, **measure_in_subprocess("moe_layer", spec)})
                except RuntimeError as exc:
                    records.append({**head, "error": str(exc).strip().splitlines()[-1]})
    if console is not None:
        print_memory_table(records, console)
    return records


_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(description="MoE-layer benchmark: moe-gmm vs transformers, side by side.")
    p.add_argument("--quick", action="store_true", help="one scaled-down case, few repeats (under a minute)")
    p.add_argument("--cases", default=None, help=f"case set: {', '.join(CASE_SETS)} (default: qwen, or quick)")
    p.add_argument("--filter", default=None, help="only cases whose name contains this text")
    p.add_argument("--dtype", default="fp32,bf16", help="comma list of fp32, bf16")
    p.add_argument(
        "--modes",
        default="train,fwdbwd",
        help="comma list of train (the training step users run, printed first: moe_gmm.bench.train_step), "
        "fwd, bwd, fwdbwd (autograd.grad)",
    )
    p.add_argument("--impls", default=None, help=f"comma list from {', '.join(IMPLS)} (the reference always runs)")
    p.add_argument(
        "--reference",
        default="hf_eager",
        choices=IMPLS,
        help="numerics and speed-up reference (default hf_eager; its O(E^2) backward takes minutes per step "
        "at E=256 on a CPU, so large-E runs compare against hf_grouped_mm)",
    )
    p.add_argument(
        "--breakdown-steps",
        type=int,
        default=3,
        help="profiled steps per phase breakdown, the median step reported (0: none)",
    )
    p.add_argument(
        "--memory",
        action="store_true",
        help="also report each impl's peak memory of one fwd+bwd step vs its budget (a fresh process per impl; "
        "the impls named in --impls, default all but hf_eager)",
    )
    add_run_arguments(p)
    from moe_gmm.bench import train_step  # imports this module: not at the top

    train_step.add_train_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    import json
    from pathlib import Path

    from rich.console import Console

    from moe_gmm.bench.table import markdown_report, print_report

    args = build_parser().parse_args(argv)
    dtypes = [_DTYPES[n] for n in split_choices(args.dtype, ("fp32", "bf16"), "--dtype")]
    modes = split_choices(args.modes, ("train", "fwd", "bwd", "fwdbwd"), "--modes")
    cases = [
        c
        for c in case_set(args.cases or ("quick" if args.quick else "qwen"))
        if not args.filter or args.filter in c.name
    ]
    if not cases:
        raise SystemExit("no case matches --cases/--filter")
    impls = layer_impls(split_choices(args.impls, IMPLS, "--impls") if args.impls else None, args.reference)
    settings = (
        TimingSettings(warmup=1, min_repeats=3, max_repeats=5, min_seconds=0.0) if args.quick else TimingSettings()
    )
    if args.repeats is not None:
        settings = TimingSettings(
            settings.warmup, args.repeats, max(settings.max_repeats, args.repeats), settings.min_seconds
        )
    if args.threads is not None:
        if args.threads < 1:
            raise SystemExit(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    console = Console()
    train = None
    if "train" in modes:  # the headline: before the autograd.grad modes
        from moe_gmm.bench import train_step

        train = train_step.run_from_args(args, cases, dtypes, settings, console)
        modes = [m for m in modes if m != "train"]
        if not modes:
            return _write_train_only(train, args, console)
    names = [i.name for i in impls]
    console.print(f"measuring machine limits ({', '.join(DTYPE_NAMES[d] for d in dtypes)} GEMM, copy bandwidth)...")
    limits = measure_limits(tuple(dtypes), quick=args.quick)
    command = "python -m benchmarks.run_moe_layer " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    with maybe_progress(not args.no_progress) as progress:
        report = run_benchmark(
            cases,
            impls,
            dtypes=dtypes,
            modes=modes,
            limits=limits,
            machine=describe_machine(),
            settings=settings,
            reference=args.reference,
            primary="moe_gmm" if "moe_gmm" in names else None,
            title="MoE layer (Qwen3.5-MoE sparse block): " + ", ".join(names),
            command=command.strip(),
            progress=progress,
            rate_probes=None if args.quick else gemm_rate_probes(dtypes, limits),
        )
    if not args.quick:
        report.notes.append(case_rate_note(report.rows, report.limits))
    print_report(report, console)
    breakdowns = []
    if args.breakdown_steps > 0 and "moe_gmm" in names:
        for case in cases:
            for dtype in dtypes:
                result = profile_breakdown(case, dtype, steps=args.breakdown_steps)
                glue = time_glue_alone(case, dtype)
                _print_breakdown(console, case, dtype, result)
                console.print(_glue_line(glue), highlight=False)
                breakdowns.append(
                    {"case": case.name, "dtype": DTYPE_NAMES[dtype], "ms_per_step": result, "glue_alone": glue}
                )
    memory = []
    if args.memory:
        memory_names = (
            split_choices(args.impls, IMPLS, "--impls") if args.impls else [n for n in DEFAULT_IMPLS if n != "hf_eager"]
        )
        memory = measure_memory(cases, dtypes, memory_names, console=console)
    if args.out:
        path = report.write_json(args.out)
        data = json.loads(path.read_text())
        data["breakdown"] = breakdowns
        if train is not None:
            data["train_step"] = train
        if args.memory:
            data["memory"] = memory
        path.write_text(json.dumps(data, indent=1) + "\n")
        console.print(f"JSON written to {path}")
    if args.markdown:
        text = markdown_report(report)
        if train is not None:
            from moe_gmm.bench.train_step import train_markdown

            text = train_markdown(train) + "\n" + text
        for b in breakdowns:
            text += f"\n\nmoe_gmm time by phase, {b['case']} {b['dtype']} (ms per step)\n\n| phase | fwd | bwd |\n|---|---:|---:|\n"
            text += "\n".join(
                f"| {ph} | {b['ms_per_step']['fwd'][ph]:.2f} | "
                + ("in other" if ph not in b["ms_per_step"]["bwd"] else f"{b['ms_per_step']['bwd'][ph]:.2f}")
                + " |"
                for ph in (*PHASES, "total")
            )
            text += "\n\n" + _glue_line(b["glue_alone"])
        if args.memory:
            text += "\n\n" + memory_markdown(memory).rstrip("\n")
        Path(args.markdown).write_text(text + "\n")
        console.print(f"Markdown written to {args.markdown}")
    return 0


def _write_train_only(train: dict[str, Any], args, console) -> int:
    """``--out`` / ``--markdown`` of a run whose only mode is ``train``."""
    import json
    from pathlib import Path

    from moe_gmm.bench.train_step import train_markdown

    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"title": "MoE layer train step", "rows": [], "train_step": train}, indent=1) + "\n")
        console.print(f"JSON written to {path}")
    if args.markdown:
        Path(args.markdown).write_text(train_markdown(train))
        console.print(f"Markdown written to {args.markdown}")
    return 0
