"""The documented example runs end to end under ``torchrun`` (2 processes, gloo)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_gmm.parallel.launch import free_port

pytest.importorskip("transformers")
pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_torchrun_ep_train_example(tmp_path):
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        str(ROOT / "examples" / "ep_train.py"),
        "--steps",
        "2",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "EP=2 x DP=1 dispatcher=alltoall" in out and "4 of 8 experts per rank" in out
    assert "step 1: loss" in out
    assert "rank 0's experts bitwise equal: True" in out
    assert (tmp_path / "model.safetensors.index.json").exists()
