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
    ]
    env["TMPDIR"] = str(tmp_path)  # the default checkpoint directory goes here, and must be removed
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "mesh dp=1 x ep=2 dispatcher=alltoall: 4 of 8 experts per rank" in out
    assert "step 1: loss" in out
    diffs = [float(line.rpartition("|diff| ")[2].rstrip(")")) for line in out.splitlines() if "|diff|" in line]
    assert len(diffs) == 2 and max(diffs) < 1e-5, out
    assert "checkpoint: ['.metadata', '__0_0.distcp', '__1_0.distcp', 'manifest.json']" in out
    assert "reloaded into a plain model: bitwise equal: True" in out
    assert not any(p.name.startswith("ep_ckpt_") for p in tmp_path.iterdir())  # temporary dirs cleaned up
