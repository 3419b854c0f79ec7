"""Train-step benchmark: the step a training loop runs, per experts implementation, side by side.

One step is what users run: ``optimizer.zero_grad(set_to_none=True)``, forward, ``loss.backward()``,
``optimizer.step()`` (AdamW). Two kinds of subject:

- the MoE block of a :class:`~moe_gmm.bench.moe_layer.MoeLayerCase`: transformers'
  ``Qwen3_5MoeSparseMoeBlock`` with the experts ``hf_eager`` / ``hf_grouped_mm`` / ``hf_moe_gmm`` and our
  :class:`~moe_gmm.layers.SparseMoeBlock` (``moe_gmm``, its own weight layout); the loss is
  ``sum(out * dy)`` for a fixed random ``dy``, and ``x`` takes a gradient too, as a layer inside a model;
- a small causal LM (:class:`LmCase`): a few decoder layers of Qwen3.5-MoE, Qwen3-MoE or Mixtral built
  from a config, the model's own next-token loss, the three transformers experts implementations.

Every implementation gets its own copy of the same initial weights, and its model is built from its
own config object: transformers records the experts implementation on the config, so two models built
from one config would both run the last one set.

Modes (:data:`TRAIN_MODES`): ``train`` (``torch.optim.AdamW`` as constructed by default: a loop over
the parameters on CPU), ``train_fused`` (:func:`moe_gmm.optim.make_adamw`: the fused kernel where the device has
one, else ``foreach``) and ``grad`` (forward + ``torch.autograd.grad(loss, params)``, no optimizer: the
layer benchmark's ``fwdbwd``, which skips the accumulation of gradients into ``.grad``).

Each (case, dtype, mode) times its implementations in interleaved rounds (:func:`time_interleaved`):
median, 20th and 80th percentiles, and the speed-up over ``hf_grouped_mm`` (its median over the
row's). Before timing, one ``loss.backward()`` per implementation is compared with the reference
(``hf_eager`` where it runs, else ``hf_grouped_mm``): relative error of the loss and of every gradient,
in transformers' layout.

:func:`profile_train_phases` splits a step by phase with ``torch.profiler``: ``zero_grad``, the
forward (``router``, ``experts`` with our ``moe::permute`` / ``moe::gmm`` / ``moe::swiglu`` /
``moe::unpermute`` inside, ``shared_expert``, the rest), the backward (the grouped matmul's grad ops,
our ``moe::*_bwd`` glue, autograd's gradient accumulation into ``.grad``) and the optimizer step.
"""

from __future__ import annotations

import copy
import gc
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from moe_gmm.bench.harness import TimingSettings, time_interleaved
from moe_gmm.bench.layer_cases import MoeLayerCase
from moe_gmm.bench.machine import DTYPE_NAMES, describe_machine
from moe_gmm.bench.table import markdown_table
from moe_gmm.optim import adamw_kind, make_adamw
from moe_gmm.testing import relative_error

__all__ = [
    "BASELINE",
    "LM_MODELS",
    "PHASE_COLUMNS",
    "TRAIN_IMPLS",
    "TRAIN_MODES",
    "LmCase",
    "Subject",
    "add_train_arguments",
    "block_subjects",
    "grad_step",
    "lm_subjects",
    "phase_tables",
    "print_train_tables",
    "profile_train_phases",
    "run_from_args",
    "run_train_steps",
    "timing_table",
    "train_markdown",
    "train_step",
]

TRAIN_MODES = ("train", "train_fused", "grad")
TRAIN_IMPLS = ("hf_eager", "hf_grouped_mm", "hf_moe_gmm", "moe_gmm")
LM_MODELS = ("qwen3_5_moe", "qwen3_moe", "mixtral")
BASELINE = "hf_grouped_mm"
_HF_EXPERTS = {"hf_eager": "eager", "hf_grouped_mm": "grouped_mm", "hf_moe_gmm": "moe_gmm"}
# Small so that the timed steps barely move the weights (the routing stays that of the first step).
_LR = 1e-5
# moe_gmm's SparseMoeBlock stores these transposed relative to transformers' layout.
_TRANSPOSED = ("experts.gate_up_proj", "experts.down_proj")


@dataclass
class Subject:
    """One implementation's model, ready to step: its loss, its parameters and how to read its gradients.

    ``grads()`` returns, after a backward, the gradients of ``inputs`` and of every parameter in
    transformers' order and layout (zeros for a parameter the step did not reach), so that subjects
    compare element by element.
    """

    name: str
    module: torch.nn.Module
    loss: Callable[[], torch.Tensor]
    params: list[torch.nn.Parameter]
    inputs: tuple[torch.Tensor, ...]
    grads: Callable[[], list[torch.Tensor]]


def train_step(subject: Subject, opt: torch.optim.Optimizer) -> torch.Tensor:
    """One training step as users write it; the phases carry ``moe::train_*`` profiler labels."""
    with record_function("moe::train_zero_grad"):
        opt.zero_grad(set_to_none=True)
        for t in subject.inputs:
            t.grad = None
    with record_function("moe::train_fwd"):
        loss = subject.loss()
    with record_function("moe::train_bwd"):
        loss.backward()
    with record_function("moe::train_optimizer"):
        opt.step()
    return loss.detach()


def grad_step(subject: Subject) -> tuple[torch.Tensor, ...]:
    """Forward + ``torch.autograd.grad`` into the inputs and parameters (nothing accumulated into ``.grad``)."""
    with record_function("moe::train_fwd"):
        loss = subject.loss()
    with record_function("moe::train_bwd"):
        return torch.autograd.grad(loss, [*subject.inputs, *subject.params])


def _grads_in_order(module: torch.nn.Module, order: Sequence[str], inputs: Sequence[torch.Tensor]):
    from moe_gmm.layers import SparseMoeBlock

    named = dict(module.named_parameters())
    transposed = _TRANSPOSED if isinstance(module, SparseMoeBlock) else ()

    def grads() -> list[torch.Tensor]:
        out = [t.grad for t in inputs]
        for name in order:
            p = named[name]
            g = torch.zeros_like(p) if p.grad is None else p.grad
            out.append(g.transpose(1, 2) if name in transposed else g)
        return out

    return grads


def _own_copy(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def block_subjects(case: MoeLayerCase, dtype: torch.dtype, names: Sequence[str]) -> dict[str, Subject]:
    """The MoE block of ``case`` once per implementation in ``names`` (from :data:`TRAIN_IMPLS`), each
    with its own copy of the same weights, the same input ``x`` and upstream gradient ``dy``."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    from moe_gmm.integrations.transformers import register_moe_gmm_experts

    _check_names(names)
    inp = case.make_inputs(dtype)
    x = inp.x
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    order = [n for n, _ in inp.hf_block.named_parameters()]
    subjects = {}
    for name in names:
        if name == "moe_gmm":
            module = copy.deepcopy(inp.block)
        else:
            if name == "hf_moe_gmm":
                register_moe_gmm_experts()
            cfg = copy.deepcopy(inp.hf_config)  # its own config: the experts implementation lives there
            cfg._experts_implementation = _HF_EXPERTS[name]
            with torch.device("meta"):
                module = Qwen3_5MoeSparseMoeBlock(cfg)
            module.load_state_dict(_own_copy(inp.hf_block), assign=True)
        module.train()
        own_x = x.detach().clone().requires_grad_(True)  # its own .grad, as the subject's own weights

        def loss(module=module, own_x=own_x) -> torch.Tensor:
            return (module(own_x) * dy).sum()

        params = list(module.parameters())
        subjects[name] = Subject(name, module, loss, params, (own_x,), _grads_in_order(module, order, (own_x,)))
    return subjects


@dataclass(frozen=True)
class LmCase:
    """A small causal LM: ``layers`` decoder layers of ``model`` (one of :data:`LM_MODELS`), every layer
    sparse, trained on ``batch x seq_len`` random tokens."""

    model: str
    num_experts: int = 64
    top_k: int = 4
    hidden: int = 512
    intermediate: int = 256
    shared_intermediate: int = 256
    layers: int = 2
    batch: int = 2
    seq_len: int = 256
    vocab: int = 2048
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 64

    def __post_init__(self) -> None:
        if self.model not in LM_MODELS:
            raise ValueError(f"model must be one of {LM_MODELS}, got {self.model!r}")
        for name in ("num_experts", "top_k", "hidden", "intermediate", "layers", "batch", "seq_len", "vocab"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k must be <= num_experts ({self.num_experts}), got {self.top_k}")

    @property
    def name(self) -> str:
        return f"{self.model} L{self.layers} E{self.num_experts}-k{self.top_k} {self.batch}x{self.seq_len}"

    def params(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def hf_config(self):
        """A fresh config object on every call (see the module docstring)."""
        common = {
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "num_experts_per_tok": self.top_k,
            "max_position_embeddings": max(4096, self.seq_len),
            "tie_word_embeddings": False,
        }
        if self.model == "mixtral":
            from transformers import MixtralConfig

            return MixtralConfig(**common, intermediate_size=self.intermediate, num_local_experts=self.num_experts)
        if self.model == "qwen3_moe":
            from transformers import Qwen3MoeConfig

            return Qwen3MoeConfig(
                **common,
                num_experts=self.num_experts,
                moe_intermediate_size=self.intermediate,
                norm_topk_prob=True,
                decoder_sparse_step=1,
            )
        from transformers import Qwen3_5MoeTextConfig

        return Qwen3_5MoeTextConfig(
            **common,
            num_experts=self.num_experts,
            moe_intermediate_size=self.intermediate,
            shared_expert_intermediate_size=self.shared_intermediate,
            # Qwen3.5's mix: linear attention, then full attention every other layer.
            layer_types=["linear_attention" if i % 2 == 0 else "full_attention" for i in range(self.layers)],
            linear_num_key_heads=self.heads // 2,
            linear_num_value_heads=self.heads,
            linear_key_head_dim=self.head_dim,
            linear_value_head_dim=self.head_dim,
        )

    def build(self, experts_implementation: str) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        cfg = self.hf_config()
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg)
        model.set_experts_implementation(experts_implementation)
        return model


def lm_subjects(case: LmCase, dtype: torch.dtype, names: Sequence[str]) -> dict[str, Subject]:
    """``case``'s causal LM once per transformers implementation in ``names``, from one initial state."""
    from moe_gmm.integrations.transformers import register_moe_gmm_experts

    _check_names(names)
    if "moe_gmm" in names:
        raise ValueError("names: moe_gmm (our SparseMoeBlock) has no causal-LM form; use the hf_* implementations")
    if "hf_moe_gmm" in names:
        register_moe_gmm_experts()
    ids = torch.randint(0, case.vocab, (case.batch, case.seq_len), generator=torch.Generator().manual_seed(2))
    state: dict[str, torch.Tensor] | None = None
    subjects = {}
    for name in names:
        model = case.build(_HF_EXPERTS[name])
        if state is None:
            state = _own_copy(model)
        else:
            model.load_state_dict(state)
        model = model.to(dtype).train()
        order = [n for n, _ in model.named_parameters()]

        def loss(model=model) -> torch.Tensor:
            return model(input_ids=ids, labels=ids).loss

        subjects[name] = Subject(name, model, loss, list(model.parameters()), (), _grads_in_order(model, order, ()))
    return subjects


def _check_names(names: Sequence[str], what: str = "names") -> None:
    unknown = [n for n in names if n not in TRAIN_IMPLS]
    if unknown or not names:
        raise ValueError(f"{what}: expected a non-empty list from {list(TRAIN_IMPLS)}, got {list(names)}")


def _compare(subjects: dict[str, Subject], reference: str) -> dict[str, dict[str, float]]:
    """One ``loss.backward()`` per subject; relative errors of the loss and every gradient vs ``reference``."""
    values = {}
    for name, s in subjects.items():
        for t in (*s.params, *s.inputs):
            t.grad = None
        loss = s.loss()
        loss.backward()
        values[name] = (loss.detach(), [g.detach().clone() for g in s.grads()])
        for t in (*s.params, *s.inputs):
            t.grad = None
    ref_loss, ref_grads = values[reference]
    errors = {}
    for name, (loss, grads) in values.items():
        grad_errs = [relative_error(g, r) for g, r in zip(grads, ref_grads, strict=True)]
        errors[name] = {"loss_rel_err": relative_error(loss, ref_loss), "grad_rel_err": max(grad_errs, default=0.0)}
    return errors


def _steppers(subjects: dict[str, Subject], mode: str) -> tuple[dict[str, Callable[[], Any]], dict[str, str]]:
    """The timed callable per subject for ``mode``, and the optimizer each one runs."""
    fns, kinds = {}, {}
    for name, s in subjects.items():
        if mode == "grad":
            fns[name], kinds[name] = (lambda s=s: grad_step(s)), "none"
            continue
        opt = torch.optim.AdamW(s.params, lr=_LR) if mode == "train" else make_adamw(s.params, lr=_LR)
        fns[name], kinds[name] = (lambda s=s, opt=opt: train_step(s, opt)), f"AdamW {adamw_kind(opt)}"
    return fns, kinds


def _clear_grads(subjects: dict[str, Subject]) -> None:
    for s in subjects.values():
        for t in (*s.params, *s.inputs):
            t.grad = None


def _time_modes(
    subjects: dict[str, Subject], modes: Sequence[str], settings: TimingSettings, base: dict[str, Any]
) -> list[dict[str, Any]]:
    reference = "hf_eager" if "hf_eager" in subjects else BASELINE
    errors = _compare(subjects, reference)
    rows = []
    for mode in modes:
        fns, kinds = _steppers(subjects, mode)
        timings = time_interleaved(fns, settings)
        del fns  # the optimizers and their state
        _clear_grads(subjects)
        base_ms = timings[BASELINE].median_s * 1e3 if BASELINE in timings else None
        for name, t in timings.items():
            median = t.median_s * 1e3
            rows.append(
                {
                    **base,
                    "mode": mode,
                    "impl": name,
                    "optimizer": kinds[name],
                    "median_ms": median,
                    "p20_ms": t.p20_s * 1e3,
                    "p80_ms": t.p80_s * 1e3,
                    "min_ms": t.min_s * 1e3,
                    "repeats": t.repeats,
                    f"speedup_vs_{BASELINE}": None if base_ms is None else base_ms / median,
                    "reference": reference,
                    **errors[name],
                }
            )
    return rows


# ------------------------------------------------------------------------------------------------
# Time by phase
# ------------------------------------------------------------------------------------------------

# Forward phases under the step's forward; the experts' sub-phases (our labels) sit inside "experts".
_FWD_KEYS = {"moe::router": "router", "moe::experts": "experts", "moe::shared_expert": "shared_expert"}
_EXPERT_KEYS = {"moe::permute": "permute", "moe::gmm": "gmm", "moe::swiglu": "swiglu", "moe::unpermute": "unpermute"}
_BWD_KEYS = {
    "moe_gmm::grouped_matmul_grad_input": "gmm_bwd",
    "moe_gmm::grouped_matmul_grad_weight": "gmm_bwd",
    "moe::permute_bwd": "glue_bwd",
    "moe::swiglu_bwd": "glue_bwd",
    "moe::unpermute_bwd": "glue_bwd",
    "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad": "grad_accumulation",
}
_STEP_KEYS = {
    "moe::train_zero_grad": "zero_grad",
    "moe::train_fwd": "forward",
    "moe::train_bwd": "backward",
    "moe::train_optimizer": "optimizer",
}
PHASE_COLUMNS = (
    "router",
    "experts",
    *_EXPERT_KEYS.values(),
    "shared_expert",
    "other_fwd",
    "backward",
    "gmm_bwd",
    "glue_bwd",
    "grad_accumulation",
    "optimizer",
    "zero_grad",
    "total",
)
# The parts a step splits into without overlap; the largest is the row's "largest" entry.
_TOP_LEVEL = ("router", "experts", "shared_expert", "other_fwd", "backward", "optimizer", "zero_grad")


def _label_hooks(module: torch.nn.Module) -> list[Any]:
    """Profiler ranges around every MoE block's router, experts and shared expert (hook handles).

    transformers' blocks carry no labels of their own; our block labels its router and shared expert
    already, so only its experts get one here (a second range of the same name would count twice).
    """
    from moe_gmm.layers import SparseMoeBlock

    handles = []

    def wrap(sub: torch.nn.Module, label: str) -> None:
        ranges: list[Any] = []

        def pre(_mod, _args):
            ranges.append(record_function(label).__enter__())

        def post(_mod, _args, _out):
            ranges.pop().__exit__(None, None, None)

        handles.extend((sub.register_forward_pre_hook(pre), sub.register_forward_hook(post)))

    for block in module.modules():
        experts, gate = getattr(block, "experts", None), getattr(block, "gate", None)
        if not isinstance(experts, torch.nn.Module) or not isinstance(gate, torch.nn.Module):
            continue
        wrap(experts, "moe::experts")
        if isinstance(block, SparseMoeBlock):
            continue
        wrap(gate, "moe::router")
        for name in ("shared_expert", "shared_expert_gate"):
            if isinstance(getattr(block, name, None), torch.nn.Module):
                wrap(getattr(block, name), "moe::shared_expert")
    return handles


def _phases_from(prof) -> dict[str, float]:
    totals = {e.key: e.cpu_time_total / 1e3 for e in prof.key_averages()}
    out = dict.fromkeys((*PHASE_COLUMNS, "forward"), 0.0)
    for table in (_FWD_KEYS, _EXPERT_KEYS, _BWD_KEYS, _STEP_KEYS):
        for key, phase in table.items():
            out[phase] += totals.get(key, 0.0)
    fwd = out.pop("forward")
    out["other_fwd"] = max(fwd - out["router"] - out["experts"] - out["shared_expert"], 0.0)
    out["total"] = fwd + out["backward"] + out["optimizer"] + out["zero_grad"]
    return out


def profile_train_phases(subject: Subject, mode: str = "train", *, steps: int = 1) -> dict[str, Any]:
    """Milliseconds by phase (:data:`PHASE_COLUMNS`) of ``subject``'s step in ``mode``, the step whose
    total is the median of ``steps`` profiled steps (one warm-up step first), plus ``largest``: the
    top-level phase that took longest (``experts`` is the experts' forward; their backward is in
    ``backward``, of which ``gmm_bwd``, ``glue_bwd`` and ``grad_accumulation`` are parts).
    The profiler's cost per op is in every phase, most in those of many short ops."""
    if mode not in TRAIN_MODES:
        raise ValueError(f"mode must be one of {TRAIN_MODES}, got {mode!r}")
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise TypeError(f"steps must be an int, got {type(steps).__name__}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    fns, kinds = _steppers({subject.name: subject}, mode)
    step = fns[subject.name]
    handles = _label_hooks(subject.module)
    try:
        step()
        results = []
        for _ in range(steps):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step()
            results.append(_phases_from(prof))
    finally:
        for h in handles:
            h.remove()
        del fns
        _clear_grads({subject.name: subject})
    results.sort(key=lambda r: r["total"])
    result: dict[str, Any] = results[(steps - 1) // 2]
    result["largest"] = max(_TOP_LEVEL, key=lambda p: result[p])
    result["optimizer_kind"] = kinds[subject.name]
    return result


# ------------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------------


def run_train_steps(
    block_cases: Sequence[MoeLayerCase],
    lm_cases: Sequence[LmCase],
    *,
    dtypes: Sequence[torch.dtype],
    impls: Sequence[str] = TRAIN_IMPLS,
    modes: Sequence[str] = ("train", "train_fused"),
    settings: TimingSettings | None = None,
    breakdown_steps: int = 0,
    eager_max_experts: int = 64,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Every block and LM case x dtype x mode, its implementations interleaved; with ``breakdown_steps``
    each train mode's step of every implementation is also split by phase.

    ``hf_eager`` runs only up to ``eager_max_experts`` experts (its backward loops over the experts on
    the host); the baseline ``hf_grouped_mm`` always runs. Returns ``{"rows", "breakdown", "skipped",
    "machine", "settings", "started_utc", "wall_s", "load_average"}``.
    """
    bad_modes = [m for m in modes if m not in TRAIN_MODES]
    if bad_modes or not modes:
        raise ValueError(f"modes: expected a non-empty list from {list(TRAIN_MODES)}, got {list(modes)}")
    _check_names(impls, "impls")
    settings = settings or TimingSettings()
    say = progress or (lambda _msg: None)
    load_start = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    breakdown: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    jobs: list[tuple[str, Any, Callable[..., dict[str, Subject]]]] = [("block", c, block_subjects) for c in block_cases]
    jobs += [(c.model, c, lm_subjects) for c in lm_cases]
    for model, case, make in jobs:
        names = [n for n in (BASELINE, *impls) if model == "block" or n != "moe_gmm"]
        names = list(dict.fromkeys(n for n in TRAIN_IMPLS if n in names))
        if "hf_eager" in names and case.num_experts > eager_max_experts:
            names.remove("hf_eager")
            skipped.append({"model": model, "case": case.name, "impl": "hf_eager", "why": f"E > {eager_max_experts}"})
        for dtype in dtypes:
            base = {"model": model, "case": case.name, "dtype": DTYPE_NAMES[dtype], "params": case.params()}
            say(f"train step: {model} {case.name} {DTYPE_NAMES[dtype]} ({', '.join(names)})")
            subjects = make(case, dtype, names)
            rows.extend(_time_modes(subjects, modes, settings, base))
            for mode in (m for m in modes if m != "grad") if breakdown_steps else ():
                for name, s in subjects.items():
                    phases = profile_train_phases(s, mode, steps=breakdown_steps)
                    breakdown.append({**base, "mode": mode, "impl": name, "ms": phases})
            del subjects
            gc.collect()
    return {
        "rows": rows,
        "breakdown": breakdown,
        "skipped": skipped,
        "machine": describe_machine().as_dict(),
        "settings": {"warmup": settings.warmup, "min_repeats": settings.min_repeats,
                     "max_repeats": settings.max_repeats, "min_seconds": settings.min_seconds},
        "started_utc": started,
        "wall_s": round(time.perf_counter() - t0, 1),
        "load_average": {"start": [round(v, 2) for v in load_start], "end": [round(v, 2) for v in os.getloadavg()]},
    }  # fmt: skip


# ------------------------------------------------------------------------------------------------
# Tables
# ------------------------------------------------------------------------------------------------


def _groups(rows: Sequence[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, dict[str, Any]]]]:
    groups: dict[tuple, tuple[dict[str, Any], dict[str, dict[str, Any]]]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["case"], r["dtype"], r["mode"]), (r, {}))[1][r["impl"]] = r
    return list(groups.values())


def _impls_of(rows: Sequence[dict[str, Any]]) -> list[str]:
    present = {r["impl"] for r in rows}
    return [n for n in TRAIN_IMPLS if n in present]


def timing_table(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and lines: one line per (model, case, dtype, mode); the optimizer, median ms [p20-p80] per
    implementation, the speed-ups over ``hf_grouped_mm`` and the largest numeric difference."""
    rows = result["rows"]
    impls = _impls_of(rows)
    others = [n for n in impls if n != BASELINE]
    header = ["case", "dtype", "mode (optimizer)", *(f"{n} ms [p20-p80]" for n in impls)]
    header += [f"{n} vs {BASELINE}" for n in others] + ["max rel err (loss, grads)"]
    lines = []
    for first, by_impl in _groups(rows):
        case = first["case"] if first["model"] != "block" else f"block {first['case']}"
        mode = first["mode"] if first["optimizer"] == "none" else f"{first['mode']} ({first['optimizer']})"
        line = [case, first["dtype"], mode]
        for n in impls:
            r = by_impl.get(n)
            line.append("-" if r is None else f"{r['median_ms']:.1f} [{r['p20_ms']:.1f}-{r['p80_ms']:.1f}]")
        for n in others:
            r = by_impl.get(n)
            line.append(
                "-" if r is None or r[f"speedup_vs_{BASELINE}"] is None else f"{r[f'speedup_vs_{BASELINE}']:.2f}x"
            )
        errs = [max(r["loss_rel_err"], r["grad_rel_err"]) for r in by_impl.values()]
        line.append(f"{max(errs):.1e} vs {first['reference']}" if errs else "-")
        lines.append(line)
    return header, lines


def phase_tables(result: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    """One time-by-phase table per (model, case, dtype): a line per phase (the experts' and the
    backward's parts indented under them), a column per (implementation, mode); ms of the median
    profiled step, and last the largest top-level phase with its share of the step."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for b in result["breakdown"]:
        groups.setdefault((b["model"], b["case"], b["dtype"]), []).append(b)
    parts = {"permute", "gmm", "swiglu", "unpermute", "gmm_bwd", "glue_bwd", "grad_accumulation"}
    tables = []
    for (model, case, dtype), entries in groups.items():
        header = ["phase", *(f"{b['impl']} {b['mode']}" for b in entries)]
        lines = [[("  " if p in parts else "") + p, *(f"{b['ms'][p]:.1f}" for b in entries)] for p in PHASE_COLUMNS]
        largest = [
            f"{b['ms']['largest']} {b['ms'][b['ms']['largest']] / (b['ms']['total'] or 1.0):.0%}" for b in entries
        ]
        lines.append(["largest", *largest])
        tables.append((f"time by phase, {model} {case} {dtype} (ms of the median profiled step)", header, lines))
    return tables


def _header_lines(result: dict[str, Any]) -> list[str]:
    la = result["load_average"]
    return [
        (
            f"started {result['started_utc']} UTC, wall {result['wall_s']:.0f} s, "
            f"load average {la['start'][0]:.2f} at start, {la['end'][0]:.2f} at end"
        ),
        (
            "step: zero_grad(set_to_none=True), forward, loss.backward(), optimizer.step(); grad: forward + "
            "torch.autograd.grad (no optimizer, nothing accumulated into .grad)"
        ),
        f"speed-up vs {BASELINE}: its median / the row's median; spread: 20th-80th percentile of the repeats",
        *(f"{s['impl']} skipped for {s['case']}: {s['why']}" for s in result["skipped"]),
    ]


def print_train_tables(result: dict[str, Any], console=None) -> None:
    """The timing table, then the time-by-phase table when there is one, with ``rich``."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    console.print("[bold]Train step (transformers' MoE block and small causal LMs), per experts implementation[/bold]")
    for line in _header_lines(result):
        console.print(line, highlight=False)
    tables = [("train step, ms per step", *timing_table(result), 3), *((*t, 1) for t in phase_tables(result))]
    for title, header, lines, labels in tables:
        table = Table(title=title, header_style="bold")
        for i, name in enumerate(header):
            table.add_column(name, justify="left" if i < labels else "right", overflow="fold")
        for line in lines:
            table.add_row(*line)
        console.print(table)


def train_markdown(result: dict[str, Any]) -> str:
    """The same tables as Markdown."""
    out = ["### Train step, per experts implementation", "", *(f"- {line}" for line in _header_lines(result))]
    header, lines = timing_table(result)
    out += ["", *markdown_table(header, lines, right=range(3, len(header)))]
    for title, header, lines in phase_tables(result):
        out += ["", title[0].upper() + title[1:], "", *markdown_table(header, lines, right=range(1, len(header)))]
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------------
# Command line (the layer benchmark's train mode)
# ------------------------------------------------------------------------------------------------


def add_train_arguments(parser) -> None:
    """The layer benchmark's options for its train mode."""
    parser.add_argument(
        "--train-modes",
        default="train,train_fused",
        help=f"comma list from {', '.join(TRAIN_MODES)}: AdamW as constructed by default, AdamW fused "
        "(or foreach), forward + autograd.grad without an optimizer",
    )
    parser.add_argument(
        "--train-impls",
        default=",".join(TRAIN_IMPLS),
        help=f"comma list from {', '.join(TRAIN_IMPLS)} ({BASELINE} always runs; moe_gmm in the block only)",
    )
    parser.add_argument(
        "--lm",
        default=None,
        help=f"causal LMs to train besides the block: comma list from {', '.join(LM_MODELS)}, or none "
        "(default: all three, none with --quick)",
    )
    parser.add_argument("--lm-experts", default="64", help="comma list of expert counts for the causal LMs")
    parser.add_argument("--lm-layers", type=int, default=2, help="decoder layers of the causal LMs")
    parser.add_argument(
        "--eager-max-experts",
        type=int,
        default=64,
        help="hf_eager runs only up to this many experts (its backward loops over the experts)",
    )


def _int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"{what}: expected a comma list of positive ints, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise SystemExit(f"{what}: expected a comma list of positive ints, got {text!r}")
    return values


def run_from_args(args, cases: Sequence[MoeLayerCase], dtypes: Sequence[torch.dtype], settings, console) -> dict:
    """Run the train mode as the layer benchmark's arguments ask, print its tables, return the result."""
    from moe_gmm.bench.runner import split_choices

    modes = split_choices(args.train_modes, TRAIN_MODES, "--train-modes")
    impls = split_choices(args.train_impls, TRAIN_IMPLS, "--train-impls")
    lm_text = args.lm if args.lm is not None else ("none" if args.quick else ",".join(LM_MODELS))
    models = [] if lm_text.strip() == "none" else split_choices(lm_text, LM_MODELS, "--lm")
    if args.lm_layers < 1:
        raise SystemExit(f"--lm-layers must be >= 1, got {args.lm_layers}")
    experts = _int_list(args.lm_experts, "--lm-experts")
    lm_cases = [LmCase(m, num_experts=e, layers=args.lm_layers) for m in models for e in experts]
    result = run_train_steps(
        cases,
        lm_cases,
        dtypes=dtypes,
        impls=impls,
        modes=modes,
        settings=settings,
        # --quick: one profiled step per implementation and mode (the profiled steps dominate its time)
        breakdown_steps=min(args.breakdown_steps, 1) if args.quick else args.breakdown_steps,
        eager_max_experts=args.eager_max_experts,
        progress=lambda msg: console.print(msg, highlight=False),
    )
    print_train_tables(result, console)
    return result
