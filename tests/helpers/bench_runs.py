"""Real, tiny benchmark runs for the baseline and comparison tests (milliseconds per row)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moe_gmm.bench import gmm
from moe_gmm.bench.machine import Limits

# Set limits instead of measuring them: the calibration's GEMMs would take most of a test's time.
LIMITS = Limits(peak_flops={"fp32": 1e11, "bf16": 2e11}, copy_bandwidth=1e10, gemm_sizes=(64,), copy_mib=1)
TINY_GMM_ARGS = ["--quick", "--cases", "tiny", "--dtype", "fp32", "--modes", "fwd", "--repeats", "1", "--no-progress"]


def other_thread_count() -> int:
    """A ``--threads`` value unlike the current count, so a runner that leaves it set is caught here."""
    return 2 if torch.get_num_threads() == 1 else 1


def tiny_gmm_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *extra: str) -> tuple[int, dict]:
    """Run ``benchmarks.run_gmm`` on the ``tiny`` cases; returns its exit code and its JSON.

    The run gets another thread count than the caller's; the runner must hand the caller's back.
    """
    monkeypatch.setattr(gmm, "measure_limits", lambda dtypes, quick=False: LIMITS)
    out = tmp_path / "run.json"
    threads = torch.get_num_threads()
    code = gmm.main([*TINY_GMM_ARGS, "--threads", str(other_thread_count()), "--out", str(out), *extra])
    assert torch.get_num_threads() == threads, f"run_gmm left {torch.get_num_threads()} threads, found {threads}"
    return code, json.loads(out.read_text())
