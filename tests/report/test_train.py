"""``moe-gmm train``: a real tiny Qwen3.5-MoE from transformers, fused vs eager losses, resume."""

from __future__ import annotations

import csv
import dataclasses
import json

import pytest

pytest.importorskip("transformers")

from moe_gmm.cli import EXIT_OK, EXIT_USAGE, main
from moe_gmm.config import RunConfig, TrainingConfig
from moe_gmm.ops.backends import registered_backends
from moe_gmm.report.train import run_training, synthetic_batch
from moe_gmm.testing import tolerance_for

STEPS = 4


def _cfg(dtype: str = "fp32") -> RunConfig:
    # The default tiny model on a smaller batch, to keep the test fast.
    return dataclasses.replace(
        RunConfig(), dtype=dtype, training=TrainingConfig(steps=STEPS, micro_batch_size=2, seq_len=16)
    )


def test_synthetic_batches_are_a_pure_function_of_seed_and_step():
    cfg = _cfg()
    a, b = synthetic_batch(cfg, 3), synthetic_batch(cfg, 3)
    assert a.equal(b) and not a.equal(synthetic_batch(cfg, 4))
    assert a.shape == (2, 16) and int(a.min()) >= 0 and int(a.max()) < cfg.model.vocab_size


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fused_and_eager_losses_align_and_fall(dtype, tmp_path):
    import torch

    # The profiler breakdown is exercised once (fp32); it adds seconds, not coverage, in bf16.
    result = run_training(_cfg(dtype), out_dir=tmp_path, steps=STEPS, profile_steps=1 if dtype == "fp32" else 0)
    assert result.ok, [r.check for r in result.report.failures]
    fused, eager = result.losses["fused"], result.losses["eager"]
    assert len(fused) == len(eager) == STEPS
    tol = tolerance_for({"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
    for f, e in zip(fused, eager):
        assert abs(f - e) <= tol.atol + tol.rtol * abs(e)
    assert fused[-1] < fused[0] and eager[-1] < eager[0]
    # The report names each experts module's backend and gives every time with its repeats.
    experts = [r for r in result.report.rows if r.section == "experts (implementation: backend)"]
    layers = result.report.meta["layers"]
    assert [(r.check, r.eager) for r in experts] == [
        (f"model.layers.{{0-{layers - 1}}}.mlp.experts", "moe_gmm_eager: eager")
    ]
    assert experts[0].fused.split(": ")[0] == "moe_gmm" and experts[0].fused.split(": ")[1] in registered_backends()
    (step_row,) = [r for r in result.report.rows if r.check == "training step"]
    assert step_row.metric == f"ms, median of {STEPS - 1} steps" and "step 1 left out" in step_row.notes
    assert step_row.details["fused"]["repeats"] == STEPS - 1
    if dtype == "fp32":
        profiled = {r.check: r for r in result.report.rows if r.check.endswith("(profiler)")}
        assert profiled["gmm (profiler)"].fused <= profiled["profiled step (profiler)"].fused
    with (tmp_path / "losses.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    assert float(rows[-1]["loss_fused"]) == pytest.approx(fused[-1], abs=1e-7)
    assert max(float(r["abs_diff"]) for r in rows) == pytest.approx(result.max_abs_diff, abs=1e-9)
    for name in ("losses.png", "train_report.md", "train_report.json"):
        assert (tmp_path / name).stat().st_size > 0, name
    # One checkpoint format: signed DCP directories, nothing else.
    assert sorted(p.name for p in tmp_path.glob("*.dcp")) == ["ckpt_eager.dcp", "ckpt_fused.dcp", "init.dcp"]
    assert not list(tmp_path.glob("*.pt"))
    for name in ("ckpt_eager.dcp", "ckpt_fused.dcp", "init.dcp"):
        assert sorted(p.name for p in (tmp_path / name).iterdir()) == [".metadata", "__0_0.distcp", "manifest.json"]
    assert result.report.meta["data_parallel_size"] == result.report.meta["expert_parallel_size"] == 1
    # The optimizer users should run: AdamW's fused kernel where the device has one (CPU does).
    import torch.distributed.checkpoint as dcp

    flag = {"optim.param_groups.0.fused": None}
    dcp.load(flag, checkpoint_id=str(tmp_path / "ckpt_fused.dcp"), no_dist=True)
    assert flag["optim.param_groups.0.fused"] is True


def test_resume_reproduces_the_uninterrupted_losses(tmp_path):
    straight = run_training(_cfg(), out_dir=tmp_path / "a", steps=STEPS, paths=("fused",), profile_steps=0)
    # Stop half way through, then resume through the CLI from the checkpoint.
    run_training(_cfg(), out_dir=tmp_path / "b", steps=STEPS // 2, paths=("fused",), profile_steps=0)
    cfg_file = tmp_path / "tiny.yaml"
    cfg_file.write_text("training:\n  steps: 4\n  micro_batch_size: 2\n  seq_len: 16\n")
    code = main(
        [
            "train",
            "--config",
            str(cfg_file),
            "--resume",
            "--out",
            str(tmp_path / "b"),
            "--paths",
            "fused",
            "--profile-steps",
            "0",
        ]
    )
    assert code == EXIT_OK
    resumed = json.loads((tmp_path / "b" / "train_report.json").read_text())
    assert resumed["meta"]["steps"] == STEPS
    with (tmp_path / "b" / "losses.csv").open() as fh:
        losses = [float(r["loss_fused"]) for r in csv.DictReader(fh)]
    # Deterministic CPU kernels, the same batches by step, optimizer state restored: bitwise equal.
    assert losses == pytest.approx(straight.losses["fused"], abs=1e-7)


def test_resume_without_checkpoint_and_ep_without_support_are_usage_errors(tmp_path, capsys):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("training:\n  steps: 2\n")
    assert main(["train", "--config", str(cfg_file), "--resume", "--out", str(tmp_path / "empty")]) == EXIT_USAGE
    assert "--resume: no" in capsys.readouterr().err
    cfg_file.write_text("parallel:\n  expert_parallel_size: 2\n")
    assert main(["train", "--config", str(cfg_file), "--out", str(tmp_path / "ep")]) == EXIT_USAGE
    assert "parallel.expert_parallel_size: 2 is larger than the world size 1" in capsys.readouterr().err
