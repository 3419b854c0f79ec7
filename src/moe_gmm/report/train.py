"""``moe-gmm train``: a short run of a tiny Qwen3.5-MoE text model on the fused and the eager path.

Both paths start from the same random initial weights (saved once as ``init.pt``) and see the same
deterministic synthetic batches, so their loss curves may differ only by the grouped matmul's
rounding. The model is the real ``transformers`` ``Qwen3_5MoeForCausalLM`` built from the config
(no downloads); its experts run through the ``"moe_gmm"`` experts implementation, fused or on the
eager per-expert loop.

Outputs in ``out_dir``: ``losses.csv``, ``losses.png``, ``train_report.{md,json}``, one checkpoint
per path (``ckpt_<path>.pt``, model + optimizer + losses; ``--resume`` continues from it and
reproduces the losses of an uninterrupted run).
"""

from __future__ import annotations

import importlib.util
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moe_gmm.config import RunConfig, load_config
from moe_gmm.report.distributed import (
    Runtime,
    apply_ep,
    clip_grad_norm,
    finish_backward,
    local_rows,
    mean_over_ranks,
    setup_runtime,
)
from moe_gmm.report.model import Report
from moe_gmm.report.timing import measure_phases, synchronize
from moe_gmm.report.train_outputs import loss_report, write_outputs

__all__ = ["TrainResult", "TrainUsageError", "build_model", "run_training", "synthetic_batch"]

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PATHS = ("fused", "eager")


class TrainUsageError(ValueError):
    """The run cannot start as asked (no checkpoint to resume from, no CUDA...): exit code 2."""


@dataclass
class TrainResult:
    losses: dict[str, list[float]]
    step_ms: dict[str, list[float]]
    max_abs_diff: float | None
    report: Report
    files: dict[str, Path] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.report.ok


# ----------------------------------------------------------------------------------------------
# Model and data
# ----------------------------------------------------------------------------------------------


def hf_text_config(cfg: RunConfig):
    """``Qwen3_5MoeTextConfig`` from the ``model`` section (random init; nothing is downloaded)."""
    from transformers import Qwen3_5MoeTextConfig

    m = cfg.model
    layer_types = [
        "full_attention" if (i + 1) % m.full_attention_interval == 0 else "linear_attention"
        for i in range(m.num_hidden_layers)
    ]
    return Qwen3_5MoeTextConfig(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        num_hidden_layers=m.num_hidden_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_key_value_heads,
        head_dim=m.head_dim,
        linear_key_head_dim=m.linear_key_head_dim,
        linear_value_head_dim=m.linear_value_head_dim,
        linear_num_key_heads=m.linear_num_key_heads,
        linear_num_value_heads=m.linear_num_value_heads,
        layer_types=layer_types,
        num_experts=m.num_experts,
        num_experts_per_tok=m.num_experts_per_tok,
        moe_intermediate_size=m.moe_intermediate_size,
        shared_expert_intermediate_size=m.shared_expert_intermediate_size,
        norm_topk_prob=m.norm_topk_prob,
        router_aux_loss_coef=m.router_aux_loss_coef,
        output_router_logits=m.router_aux_loss_coef > 0,
        max_position_embeddings=m.max_position_embeddings,
        tie_word_embeddings=False,
    )


def build_model(cfg: RunConfig, path: str) -> torch.nn.Module:
    """A ``Qwen3_5MoeForCausalLM`` whose experts run moe-gmm's grouped matmul.

    ``path="fused"`` uses the configured backend (``model.gmm_backend``; the eager loop when
    ``model.use_grouped_expert_matmul`` is false), ``path="eager"`` the per-expert loop.
    """
    from transformers import Qwen3_5MoeForCausalLM

    from moe_gmm.integrations.transformers import register_moe_gmm_experts

    if path == "fused":
        impl = register_moe_gmm_experts(
            "moe_gmm", backend=cfg.model.gmm_backend, fused=cfg.model.use_grouped_expert_matmul
        )
    else:
        impl = register_moe_gmm_experts("moe_gmm_eager", fused=False)
    torch.manual_seed(cfg.seed)
    model = Qwen3_5MoeForCausalLM(hf_text_config(cfg))
    model.set_experts_implementation(impl)
    return model


def synthetic_batch(cfg: RunConfig, step: int) -> torch.Tensor:
    """``[B, S]`` token ids for ``step``: a fixed random successor table followed 90% of the time.

    A pure function of (seed, step), so a resumed run sees the same batches; the structure makes
    the loss fall visibly within a few steps.
    """
    m, t = cfg.model, cfg.training
    table = torch.randperm(m.vocab_size, generator=torch.Generator().manual_seed(cfg.seed + 7))
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    ids = torch.empty(t.micro_batch_size, t.seq_len, dtype=torch.int64)
    ids[:, 0] = torch.randint(0, m.vocab_size, (t.micro_batch_size,), generator=g)
    noise = torch.randint(0, m.vocab_size, (t.micro_batch_size, t.seq_len), generator=g)
    follow = torch.rand(t.micro_batch_size, t.seq_len, generator=g) < 0.9
    for s in range(1, t.seq_len):
        ids[:, s] = torch.where(follow[:, s], table[ids[:, s - 1]], noise[:, s])
    return ids


# ----------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------


def _optimizer(cfg: RunConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    from moe_gmm.bench.train_step import make_adamw

    # Fused (else foreach) AdamW: the default one loops over the parameters with a dozen element-wise
    # passes each, which on CPU outweighed the experts in the benchmark's train step.
    return make_adamw(model.parameters(), lr=cfg.training.lr, weight_decay=cfg.training.weight_decay)


@dataclass
class _Run:
    """What every step needs: the config, this process's place in the EP group, device and dtype."""

    cfg: RunConfig
    rt: Runtime
    device: torch.device
    dtype: torch.dtype
    out: Path

    def model(self, path: str, state: dict | None = None) -> torch.nn.Module:
        """The model for ``path`` from ``init.pt``, sharded over the EP group, then ``state`` loaded."""
        model = build_model(self.cfg, path)
        model.load_state_dict(torch.load(self.out / "init.pt", weights_only=True))
        model.to(device=self.device, dtype=self.dtype).train()
        fused = path == "fused" and self.cfg.model.use_grouped_expert_matmul
        apply_ep(model, self.rt, self.cfg, fused=fused, backend=self.cfg.model.gmm_backend)
        if state is not None:
            model.load_state_dict(state)
        return model

    def checkpoint(self, path: str) -> Path:
        # Under EP each rank holds different expert shards: one file per rank.
        suffix = f"_rank{self.rt.rank}of{self.rt.world}" if self.rt.distributed else ""
        return self.out / f"ckpt_{path}{suffix}.pt"

    def step(self, model, opt, step: int) -> float:
        ids = local_rows(synthetic_batch(self.cfg, step), self.rt).to(self.device)
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        finish_backward(model, self.rt)
        if self.cfg.training.grad_clip > 0:
            clip_grad_norm(model, self.cfg.training.grad_clip, self.rt)
        opt.step()
        # Host sync: the loss is logged every step (the mean over ranks is the global batch's loss).
        return mean_over_ranks(float(loss.detach()), self.rt, self.device)


def _save(path: Path, model, opt, step: int, losses: list[float], step_ms: list[float]) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "step": step,
            "losses": losses,
            "step_ms": step_ms,
        },
        tmp,
    )
    os.replace(tmp, path)  # never leave a half-written checkpoint behind


def _run_path(run: _Run, path: str, steps: int, resume: bool, progress, profile_steps: int) -> tuple:
    model = run.model(path)
    opt = _optimizer(run.cfg, model)
    ckpt_path = run.checkpoint(path)
    losses: list[float] = []
    step_ms: list[float] = []
    if resume:
        if not ckpt_path.exists():
            raise TrainUsageError(f"--resume: no checkpoint {ckpt_path} (run without --resume first)")
        state = torch.load(ckpt_path, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        losses, step_ms = list(state["losses"]), list(state["step_ms"])
        if len(losses) >= steps:
            raise TrainUsageError(
                f"--resume: checkpoint {ckpt_path} is already at step {len(losses)} >= --steps {steps}"
            )
    task = progress.add_task(f"train {path}", total=steps, completed=len(losses))
    every = run.cfg.training.checkpoint_every
    for step in range(len(losses) + 1, steps + 1):
        start = time.perf_counter()
        losses.append(run.step(model, opt, step))
        synchronize(run.device)
        step_ms.append((time.perf_counter() - start) * 1e3)
        progress.update(task, advance=1, description=f"train {path} loss {losses[-1]:.4f}")
        if (every and step % every == 0) or step == steps:
            _save(ckpt_path, model, opt, step, losses, step_ms)
    if not profile_steps:
        return losses, step_ms, {}
    # Phase breakdown on a copy, so profiling does not move the trained weights.
    probe = run.model(path, state=model.state_dict())
    probe_opt = _optimizer(run.cfg, probe)
    phases = measure_phases(lambda: run.step(probe, probe_opt, steps + 1), run.device, steps=profile_steps)
    return losses, step_ms, phases


def run_training(
    config: str | Path | RunConfig,
    *,
    out_dir: str | Path = "out/train",
    steps: int | None = None,
    resume: bool = False,
    paths: tuple[str, ...] = PATHS,
    profile_steps: int = 2,
    console=None,
) -> TrainResult:
    """Train every path in ``paths`` for ``steps`` (default ``training.steps``); write CSV/PNG/report.

    After training, ``profile_steps`` extra steps on a copy of each trained model run under the
    profiler for the phase breakdown (0 skips it). Under ``torchrun`` with
    ``parallel.expert_parallel_size`` = the number of processes, the experts are sharded over the
    ranks (see :mod:`moe_gmm.report.distributed`) and rank 0 writes the outputs.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from moe_gmm.report.render import render_terminal, wide_console

    cfg = config if isinstance(config, RunConfig) else load_config(config)
    if importlib.util.find_spec("transformers") is None:
        raise TrainUsageError("moe-gmm train builds a transformers model: pip install 'moe-gmm[hf]'")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise TrainUsageError("device: cuda requested but torch.cuda.is_available() is False")
    out = Path(out_dir)
    if resume and not (out / "init.pt").exists():
        raise TrainUsageError(f"--resume: no {out / 'init.pt'} (run without --resume first)")
    rt = setup_runtime(cfg)
    try:
        run = _Run(cfg, rt, torch.device(cfg.device), _DTYPES[cfg.dtype], out)
        steps = steps or cfg.training.steps
        if rt.is_main:
            out.mkdir(parents=True, exist_ok=True)
            if not resume:
                torch.save(build_model(cfg, "eager").state_dict(), out / "init.pt")
        _barrier(rt)
        console = console or wide_console()
        losses, step_ms, phases = {}, {}, {}
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=False, disable=not rt.is_main) as progress:
            for path in paths:
                losses[path], step_ms[path], phases[path] = _run_path(run, path, steps, resume, progress, profile_steps)
        report, max_diff = loss_report(cfg, losses, step_ms, phases, run.dtype, rt.world)
        files: dict[str, Path] = {}
        if rt.is_main:
            files = write_outputs(report, out, losses, step_ms)
            render_terminal(report, console)
            for name, p in files.items():
                console.print(f"wrote {p}  [dim]({name})[/dim]")
        _barrier(rt)
    finally:
        if rt.distributed:
            import torch.distributed as dist

            dist.destroy_process_group()
    return TrainResult(losses, step_ms, max_diff, report, files)


def _barrier(rt: Runtime) -> None:
    if rt.distributed:
        import torch.distributed as dist

        dist.barrier(group=rt.group)
