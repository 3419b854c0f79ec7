"""``moe-gmm train``: a short run of a tiny Qwen3.5-MoE text model on the fused and the eager path.

Both paths start from the same random initial weights (saved once as ``init.dcp``) and see the same
deterministic synthetic batches, so their loss curves may differ only by the grouped matmul's
rounding. The model is the real ``transformers`` ``Qwen3_5MoeForCausalLM`` built from the config
(no downloads); its experts run through the ``"moe_gmm"`` experts implementation, fused or on the
eager per-expert loop.

Outputs in ``out_dir``: ``losses.csv``, ``losses.png``, ``train_report.{md,json}``, one checkpoint
per path (``ckpt_<path>.dcp``: model, optimizer, step, losses and the run's identity; ``--resume``
continues from it and reproduces the losses of an uninterrupted run). Every checkpoint, ``init.dcp``
included, is one format in one process and under ``torchrun``: a signed DCP directory
(:mod:`moe_gmm.parallel.dcp`), resumable at any other (dp, ep) or in one process. A damaged one, or
one of another run (seed, config), is a usage error before any step; the folder is locked for the
run and Ctrl-C stops it between checkpoints (:mod:`moe_gmm.report.train_checkpoint`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moe_gmm._validation import writable_directory
from moe_gmm.checksum import CheckpointError
from moe_gmm.config import ConfigError, RunConfig, load_config
from moe_gmm.integrations.transformers import describe_experts
from moe_gmm.parallel.mesh import ParallelizedMoe
from moe_gmm.report.distributed import (
    Runtime,
    clip_grad_norm,
    local_rows,
    mean_over_ranks,
    parallelize,
    scale_loss,
    setup_runtime,
)
from moe_gmm.report.model import Report
from moe_gmm.report.timing import measure_phases, synchronize
from moe_gmm.report.train_checkpoint import (
    OutDirError,
    check_out_kinds,
    check_run_identity,
    deferred_interrupt,
    lock_out_dir,
    run_identity,
)
from moe_gmm.report.train_outputs import loss_report, write_outputs

__all__ = ["TrainInterrupted", "TrainResult", "TrainUsageError", "build_model", "run_training", "synthetic_batch"]

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PATHS = ("fused", "eager")


class TrainUsageError(ValueError):
    """The run cannot start as asked (no checkpoint to resume from, no CUDA...): exit code 2."""


class TrainInterrupted(Exception):
    """Ctrl-C stopped the run; the message names the last complete checkpoint of each path (exit code 130)."""


INIT = "init.dcp"
_PROGRESS = ("step", "losses", "step_ms", "run")


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
    from moe_gmm.optim import make_adamw
    from moe_gmm.parallel.guards import check_optimizer

    # Fused (else foreach) AdamW: the default one loops over the parameters with a dozen element-wise
    # passes each, which on CPU outweighed the experts in the benchmark's train step.
    opt = make_adamw(model.parameters(), lr=cfg.training.lr, weight_decay=cfg.training.weight_decay)
    check_optimizer(opt, model)
    return opt


@dataclass
class _Run:
    """What every step needs: the config, this process's place in the EP group, device and dtype."""

    cfg: RunConfig
    rt: Runtime
    device: torch.device
    dtype: torch.dtype
    out: Path
    init_state: dict[str, torch.Tensor]
    experts: dict[str, list] = field(default_factory=dict)  # path -> describe_experts(model), for the report
    saved: dict[str, tuple[Path, int]] = field(default_factory=dict)  # path -> its last complete checkpoint

    def model(self, path: str, state: dict | None = None) -> tuple[torch.nn.Module, ParallelizedMoe | None]:
        """The model for ``path`` from ``init.dcp``, parallelized on the mesh, then ``state`` loaded."""
        model = build_model(self.cfg, path)
        model.load_state_dict(self.init_state)
        model.to(device=self.device, dtype=self.dtype).train()
        fused = path == "fused" and self.cfg.model.use_grouped_expert_matmul
        par = parallelize(model, self.rt, self.cfg, fused=fused, backend=self.cfg.model.gmm_backend)
        if state is not None:
            model.load_state_dict(state)
        return model, par

    def checkpoint(self, path: str) -> Path:
        # A DCP directory, whose layout does not depend on the (dp, ep) it was saved at.
        return self.out / f"ckpt_{path}.dcp"

    def step(self, model, par: ParallelizedMoe | None, opt, step: int) -> float:
        ids = local_rows(synthetic_batch(self.cfg, step), self.rt).to(self.device)
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        scale_loss(loss, par).backward()
        if self.cfg.training.grad_clip:  # null or 0: no clipping
            clip_grad_norm(model, self.cfg.training.grad_clip, par)
        opt.step()
        # Host sync: the loss is logged every step (the mean over ranks is the global batch's loss).
        return mean_over_ranks(float(loss.detach()), self.rt, self.device)


def _save(run: _Run, path: str, model, par, opt, step: int, losses: list[float], step_ms: list[float]) -> None:
    from moe_gmm.parallel.dcp import save_checkpoint

    extra = {"step": step, "losses": losses, "step_ms": step_ms, "run": run_identity(run.cfg)}
    with deferred_interrupt():  # Ctrl-C here waits until the checkpoint is signed, in place and recorded
        save_checkpoint(run.checkpoint(path), par if par is not None else model, opt, extra=extra)
        run.saved[path] = (run.checkpoint(path), step)


def _check_identity(run_cfg: RunConfig, saved: object, ckpt: Path) -> None:
    problem = check_run_identity(saved, run_cfg, f"checkpoint {str(ckpt)!r}")
    if problem is not None:
        raise TrainUsageError(f"--resume: {problem}; resume it with its own config, or train into another --out")


def _resume_state(run: _Run, path: str) -> dict:
    """The verified progress of ``path``'s checkpoint: signed, of this run, step and losses agreeing."""
    from moe_gmm.parallel.dcp import checkpoint_extra

    ckpt_path = run.checkpoint(path)
    if not ckpt_path.exists():
        raise TrainUsageError(f"--resume: no checkpoint {ckpt_path} (run without --resume first)")
    state = checkpoint_extra(ckpt_path, _PROGRESS)  # every byte checked against its manifest first
    _check_identity(run.cfg, state["run"], ckpt_path)
    losses, step_ms = state["losses"], state["step_ms"]
    if not (isinstance(losses, list) and isinstance(step_ms, list) and len(losses) == len(step_ms) == state["step"]):
        raise CheckpointError(f"checkpoint {str(ckpt_path)!r}: step, losses and step_ms disagree")
    run.saved[path] = (ckpt_path, state["step"])
    return state


def _check_resume_steps(run: _Run, states: dict[str, dict], steps: int) -> None:
    """Something must be left to train, and no checkpoint may be past ``steps`` (a path already done is kept)."""
    done = {path: len(state["losses"]) for path, state in states.items()}
    path = max(done, key=done.get)
    if done[path] > steps or all(n >= steps for n in done.values()):
        raise TrainUsageError(
            f"--resume: checkpoint {run.checkpoint(path)} is already at step {done[path]} >= --steps {steps}"
        )


def _run_path(run: _Run, path: str, steps: int, state: dict | None, progress, profile_steps: int) -> tuple:
    from moe_gmm.parallel.dcp import load_checkpoint

    model, par = run.model(path)
    run.experts[path] = describe_experts(model)
    opt = _optimizer(run.cfg, model)
    losses: list[float] = []
    step_ms: list[float] = []
    if state is not None:  # every byte, shape, E and finite value checked before any copy
        load_checkpoint(run.checkpoint(path), par if par is not None else model, opt)
        losses, step_ms = list(state["losses"]), list(state["step_ms"])
    task = progress.add_task(f"train {path}", total=steps, completed=len(losses))
    every = run.cfg.training.checkpoint_every
    for step in range(len(losses) + 1, steps + 1):
        start = time.perf_counter()
        losses.append(run.step(model, par, opt, step))
        synchronize(run.device)
        step_ms.append((time.perf_counter() - start) * 1e3)
        progress.update(task, advance=1, description=f"train {path} loss {losses[-1]:.4f}")
        if (every and step % every == 0) or step == steps:
            if run.rt.distributed:  # what every rank holds whole (buffers) must not have drifted apart
                from moe_gmm.parallel.guards import verify_replicas

                verify_replicas(model, None, what=f"train {path} at step {step}")
            _save(run, path, model, par, opt, step, losses, step_ms)
    if not profile_steps:
        return losses, step_ms, {}
    # Phase breakdown on a copy, so profiling does not move the trained weights.
    probe, probe_par = run.model(path, state=model.state_dict())
    probe_opt = _optimizer(run.cfg, probe)
    phases = measure_phases(lambda: run.step(probe, probe_par, probe_opt, steps + 1), run.device, steps=profile_steps)
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
    profiler for the phase breakdown (0 skips it). Under ``torchrun`` the ranks form a
    ``(world / parallel.expert_parallel_size, parallel.expert_parallel_size)`` mesh and the model
    is parallelized on it (see :mod:`moe_gmm.report.distributed`); rank 0 writes the outputs.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from moe_gmm.report.render import render_terminal, wide_console

    cfg = config if isinstance(config, RunConfig) else load_config(config)
    if importlib.util.find_spec("transformers") is None:
        raise TrainUsageError("moe-gmm train builds a transformers model: pip install 'moe-gmm[hf]'")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise TrainUsageError("device: cuda requested but torch.cuda.is_available() is False")
    if cfg.device == "npu" and importlib.util.find_spec("torch_npu") is None:
        raise TrainUsageError("device: npu requested but torch_npu is not installed")
    if "fused" in paths:
        _check_backend(cfg)
    out = Path(out_dir)
    try:
        writable_directory(out, "--out")
        check_out_kinds(out, _OUT_FILES, _out_directories(paths))
    except ValueError as exc:
        raise TrainUsageError(str(exc)) from None
    if resume and not (out / INIT).exists():
        raise TrainUsageError(f"--resume: no {out / INIT} (run without --resume first)")
    rt = setup_runtime(cfg)
    saved: dict[str, tuple[Path, int]] = {}
    try:
        with _locked(out, rt):
            steps = steps or cfg.training.steps
            init = _init_state(cfg, out, resume)
            run = _Run(cfg, rt, torch.device(cfg.device), _DTYPES[cfg.dtype], out, init, saved=saved)
            # Every checkpoint is checked before the first step, so a damaged one never costs a run.
            states = {path: _resume_state(run, path) for path in paths} if resume else {}
            if states:
                _check_resume_steps(run, states, steps)
            console = console or wide_console()
            losses, step_ms, phases = {}, {}, {}
            columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
            with Progress(*columns, console=console, transient=False, disable=not rt.is_main) as progress:
                for path in paths:
                    state = states.pop(path, None)
                    run_out = _run_path(run, path, steps, state, progress, profile_steps)
                    losses[path], step_ms[path], phases[path] = run_out
            report, max_diff = loss_report(cfg, losses, step_ms, phases, run.dtype, rt.mesh_shape, run.experts)
            files: dict[str, Path] = {}
            if rt.is_main:
                files = write_outputs(report, out, losses, step_ms)
                render_terminal(report, console)
                for name, p in files.items():
                    console.print(f"wrote {p}  [dim]({name})[/dim]")
            _barrier(rt)
    except KeyboardInterrupt:
        raise TrainInterrupted(_interrupted(saved)) from None
    finally:
        if rt.distributed:
            import torch.distributed as dist

            dist.destroy_process_group()
    return TrainResult(losses, step_ms, max_diff, report, files)


_OUT_FILES = (
    "losses.csv", "losses.png", "train_report.md", "train_report.json", "report.md", "report.json", ".lock",
)  # fmt: skip


def _out_directories(paths: tuple[str, ...]) -> tuple[str, ...]:
    """Every checkpoint directory the run may write, with the names its atomic swap uses."""
    names = [INIT, *(f"ckpt_{p}.dcp" for p in paths)]
    return tuple(n + suffix for n in names for suffix in ("", ".tmp", ".old"))


@contextlib.contextmanager
def _locked(out: Path, rt: Runtime):
    """Hold ``--out``'s lock (rank 0 takes it; every rank learns whether it could) for the block."""
    with contextlib.ExitStack() as stack:
        problem = None
        if rt.is_main:
            try:
                stack.enter_context(lock_out_dir(out))
            except OutDirError as exc:
                problem = str(exc)
        problem = _first_problem(problem, rt)
        if problem is not None:
            raise TrainUsageError(problem)
        yield


def _first_problem(problem: str | None, rt: Runtime) -> str | None:
    """Rank 0's ``problem`` on every rank (a rank raising alone would leave the others waiting)."""
    if not rt.distributed:
        return problem
    import torch.distributed as dist

    box = [problem]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _init_state(cfg: RunConfig, out: Path, resume: bool) -> dict[str, torch.Tensor]:
    """The initial weights both paths start from: written to ``init.dcp`` by a new run, read back by every run."""
    from moe_gmm.parallel.dcp import load_checkpoint, save_checkpoint

    model = build_model(cfg, "eager")
    if not resume:
        with deferred_interrupt():
            save_checkpoint(out / INIT, model, extra={"run": run_identity(cfg)})
    extra = load_checkpoint(out / INIT, model)  # verified against its manifest; the same weights on every rank
    _check_identity(cfg, extra.get("run"), out / INIT)
    return model.state_dict()


def _interrupted(saved: dict[str, tuple[Path, int]]) -> str:
    """The one line Ctrl-C prints: where to resume from."""
    if not saved:
        return "interrupted before the first checkpoint; nothing to resume"
    complete = ", ".join(f"{ckpt} (step {step})" for ckpt, step in saved.values())
    return f"interrupted; last complete checkpoint intact: {complete}; continue with --resume"


def _check_backend(cfg: RunConfig) -> None:
    """The fused path's backend must run the two expert matmuls on this device and dtype (not fail at step 1).

    With ``model.gmm_backend: null`` the choice is ``$MOE_GMM_BACKEND``'s or automatic; a bad
    environment value is named as such.
    """
    m = cfg.model
    if not m.use_grouped_expert_matmul:
        return
    from moe_gmm.ops.backends import BACKEND_ENV_VAR, select_backend

    key = (
        "model.gmm_backend"
        if m.gmm_backend is not None or not os.environ.get(BACKEND_ENV_VAR)
        else f"${BACKEND_ENV_VAR}"
    )

    device, dtype = torch.device(cfg.device), _DTYPES[cfg.dtype]
    for k_dim, n_dim in ((m.hidden_size, 2 * m.moe_intermediate_size), (m.moe_intermediate_size, m.hidden_size)):
        x = torch.empty(1, k_dim, dtype=dtype, device=device)
        w = torch.empty(1, k_dim, n_dim, dtype=dtype, device=device)
        try:
            select_backend(x, w, m.gmm_backend)
        except ValueError as exc:
            # Errors of $MOE_GMM_BACKEND's name already start with the variable.
            raise ConfigError(str(exc) if str(exc).startswith(key) else f"{key}: {exc}") from None


def _barrier(rt: Runtime) -> None:
    if rt.distributed:
        import torch.distributed as dist

        dist.barrier()
