"""``benchmarks/gpu_check.py --dry-run``: the GPU check's code paths on CPU (Triton interpreter)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

# Not importorskip: importing triton before the dry run sets TRITON_INTERPRET would fix the
# interpreter off for the whole process.
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed: gpu_check needs it", allow_module_level=True)

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the real check, not the dry run")
def test_dry_run_checks_times_and_writes_json(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", gpu_check)  # dataclasses look their module up there
    spec.loader.exec_module(gpu_check)
    monkeypatch.chdir(tmp_path)  # as written, without --out: the results land in ./out/
    assert gpu_check.main(["--dry-run"]) == 0
    out = tmp_path / "out" / "gpu_check.json"
    result = json.loads(out.read_text())
    assert result["dry_run"] is True and result["machine"]["device"] == "cpu"
    checked = {(c["backend"], c["dtype"]) for c in result["checks"]}
    assert {("triton", "float32"), ("triton", "float16"), ("triton", "bfloat16"), ("torch", "bfloat16")} <= checked
    impls = {r["impl"] for r in result["gemm"]}
    assert {"dense_mm", "triton", "torch", "eager"} <= impls
    assert all(r["ms"] > 0 and r["frac_dense"] > 0 for r in result["gemm"])
    assert {r["impl"] for r in result["moe_mlp"]} == {"unfused_triton", "unfused_auto", "gather_scatter"}
