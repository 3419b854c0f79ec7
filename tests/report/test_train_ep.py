"""``moe-gmm train`` under ``torchrun --nproc-per-node 2`` with EP 2 reproduces the 1-process losses."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from moe_gmm.parallel.launch import free_port
from moe_gmm.report.train import run_training

REPO = Path(__file__).resolve().parents[2]
CONFIG = "training:\n  steps: 2\n  micro_batch_size: 2\n  seq_len: 16\n"


def _losses(path: Path, column: str) -> list[float]:
    with path.open() as fh:
        return [float(r[column]) for r in csv.DictReader(fh)]


@pytest.mark.distributed
def test_two_process_expert_parallel_run_matches_one_process(tmp_path):
    cfg1, cfg2 = tmp_path / "ep1.yaml", tmp_path / "ep2.yaml"
    cfg1.write_text(CONFIG)
    cfg2.write_text(CONFIG + "parallel:\n  expert_parallel_size: 2\n")
    single = run_training(cfg1, out_dir=tmp_path / "one", paths=("fused",), profile_steps=0)

    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        "-m",
        "moe_gmm.cli",
        "train",
        "--config",
        str(cfg2),
        "--out",
        str(tmp_path / "two"),
        "--profile-steps",
        "0",
    ]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    two = tmp_path / "two"
    # Each rank checkpoints its own expert shard.
    assert {p.name for p in two.glob("ckpt_*.pt")} == {
        f"ckpt_{path}_rank{r}of2.pt" for path in ("fused", "eager") for r in (0, 1)
    }
    for path in ("fused", "eager"):  # on CPU in fp32 the 1-process fused and eager losses are equal
        ep = _losses(two / "losses.csv", f"loss_{path}")
        # Same batches and weights; only the summation order of the gradient reductions differs.
        assert ep == pytest.approx(single.losses["fused"], rel=1e-5, abs=1e-5), path
    # The report names the sharded experts and the backend their local grouped matmuls run on.
    rows = json.loads((two / "train_report.json").read_text())["rows"]
    (experts,) = [r for r in rows if r["section"] == "experts (implementation: backend)"]
    assert experts["eager"] == "moe_gmm expert parallel: eager"
    assert experts["fused"].startswith("moe_gmm expert parallel: ") and not experts["fused"].endswith(": eager")
