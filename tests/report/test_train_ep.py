"""``moe-gmm train`` on a (dp, ep) mesh: ``torchrun --nproc-per-node 4`` with ``--config tiny_dp2_ep2``
trains 2 steps and saves a DCP checkpoint; resumed at (1, 4) for a third step and then in one
process for a fourth, the losses equal an uninterrupted 4-step run in one process.

The real ``torchrun`` runs once; the resume runs the same entry point (``run_training`` with
``$WORLD_SIZE`` set) on ``run_ranks``' gloo ranks, which start faster.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("transformers")

from moe_gmm.cli import main
from moe_gmm.parallel.dcp import checkpoint_metadata
from moe_gmm.parallel.launch import free_port, run_ranks
from moe_gmm.report.train import run_training

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "src" / "moe_gmm" / "configs" / "tiny_dp2_ep2.yaml"

pytestmark = pytest.mark.distributed


def _losses(path: Path, column: str = "loss_fused") -> list[float]:
    with path.open() as fh:
        return [float(r[column]) for r in csv.DictReader(fh)]


def _config_at(tmp_path: Path, dp: int | None, ep: int) -> Path:
    data = yaml.safe_load(CONFIG.read_text())
    data["parallel"] |= {"data_parallel_shard": dp, "expert_parallel_size": ep}
    path = tmp_path / f"dp{dp}_ep{ep}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _resume_worker(rank: int, world: int, config: str, out: str) -> list[float]:
    os.environ["WORLD_SIZE"] = str(world)  # what torchrun sets; the process group is already up
    result = run_training(config, out_dir=out, steps=3, resume=True, paths=("fused",), profile_steps=0)
    return result.losses["fused"]


def test_torchrun_dp2_ep2_resumes_at_1x4_with_the_same_losses(tmp_path):
    single = run_training(
        _config_at(tmp_path, None, 1), out_dir=tmp_path / "one", steps=4, paths=("fused",), profile_steps=0
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(free_port()),
        "-m", "moe_gmm.cli", "train", "--config", "tiny_dp2_ep2", "--out", str(tmp_path / "mesh"), "--steps", "2",
        "--paths", "fused", "--profile-steps", "0",
    ]  # fmt: skip
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = tmp_path / "mesh"
    two_steps = _losses(out / "losses.csv")
    assert len(two_steps) == 2 and two_steps == pytest.approx(single.losses["fused"][:2], rel=1e-5, abs=1e-6)
    # One DCP directory for every rank, the experts recorded whole (E = 8), no per-rank files.
    assert sorted(p.name for p in out.glob("ckpt_*")) == ["ckpt_fused.dcp"]
    metadata = checkpoint_metadata(out / "ckpt_fused.dcp").state_dict_metadata
    assert tuple(metadata["model.model.layers.0.mlp.experts.gate_up_proj"].size) == (8, 64, 64)
    assert "optim.state.model.layers.1.mlp.experts.down_proj.exp_avg_sq" in metadata
    # The report names the sharded experts and the backend their local grouped matmuls run on.
    report = json.loads((out / "train_report.json").read_text())
    assert (report["meta"]["data_parallel_size"], report["meta"]["expert_parallel_size"]) == (2, 2)  # the mesh's
    rows = report["rows"]
    (experts,) = [r for r in rows if r["section"] == "experts (implementation: backend)"]
    assert experts["fused"].startswith("moe_gmm expert parallel: ") and not experts["fused"].endswith(": eager")

    resumed = run_ranks(_resume_worker, 4, str(_config_at(tmp_path, 1, 4)), str(out), timeout_s=240)
    for rank, losses in enumerate(resumed):
        assert losses[:2] == pytest.approx(two_steps, abs=1e-8), rank  # from the checkpoint (csv: 8 decimals)
        assert losses == pytest.approx(single.losses["fused"][:3], rel=1e-5, abs=1e-6), rank
    assert _losses(out / "losses.csv") == pytest.approx(resumed[0], abs=1e-8)

    # One process continues the DCP checkpoint (no process group), then owns the path's checkpoint;
    # the CLI's --expert-parallel-size turns the (2, 2) config into one for a single process.
    argv = ["train", "--config", str(CONFIG), "--out", str(out), "--steps", "4", "--resume", "--paths", "fused"]
    assert main([*argv, "--profile-steps", "0", "--expert-parallel-size", "1"]) == 0
    alone = _losses(out / "losses.csv")
    assert alone[:3] == pytest.approx(resumed[0], abs=1e-8)
    assert alone == pytest.approx(single.losses["fused"], rel=1e-5, abs=1e-6)
    assert sorted(p.name for p in out.glob("ckpt_*")) == ["ckpt_fused.dcp"]  # one format, one process or many


def test_mesh_shape_must_match_the_processes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"parallel\.data_parallel_shard: 2 x parallel\.expert_parallel_size 4 = 8"):
        run_training(_config_at(tmp_path, 2, 4), out_dir=tmp_path / "x", paths=("fused",), profile_steps=0)
    argv = ["train", "--config", str(CONFIG), "--out", str(tmp_path / "y"), "--expert-parallel-size"]
    assert main([*argv, "0"]) == 2
    assert "--expert-parallel-size must be >= 1, got 0" in capsys.readouterr().err
    assert main([*argv, "3"]) == 2  # E = 8 experts do not split over 3 ranks
    assert "parallel.expert_parallel_size: 3 must divide model.num_experts 8" in capsys.readouterr().err
