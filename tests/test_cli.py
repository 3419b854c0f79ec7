"""``moe-gmm`` end to end: validate fills every row, catches a broken backend; usage errors exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_gmm.cli import EXIT_FAIL, EXIT_OK, EXIT_USAGE, main
from moe_gmm.ops.backends import GmmBackend, register_backend, unregister_backend
from moe_gmm.ops.backends import eager as eager_backend
from moe_gmm.ops.backends.base import host_bounds

REPO = Path(__file__).resolve().parents[1]

# Every kind of row the measurement table must hold (a substring of the row's check name).
REQUIRED_CHECKS = [
    "forward, uniform groups",
    "forward, uneven groups",
    "forward, empty groups",
    "grad_input, uniform groups",
    "grad_input, empty groups",
    "grad_weight per expert, uneven groups",
    "grad_weight of empty experts, empty groups",
    "routed-expert output",
    "shared expert held fixed",
    "MoE block output (shared expert held fixed)",
    "grad_input",
    "gate_up_proj grad per expert",
    "down_proj grad of empty experts",
    "tokens_per_expert load",
    "empty experts",
    "routing weights sum to 1 per token",
    "top-k ids consistent with permute/unpermute",
    "group_list.sum() == permuted rows",
    "gate_up GMM output [R, 2I]",
    "down GMM output [R, H]",
    "unpermute output [T, H]",
    "grad shapes == parameter shapes",
    "GMM time (the two expert matmuls",
    "permute/unpermute time",
    "host time",
    "MoE block training step",
    "experts.gate_up_proj grad per expert (HF layout)",
    "experts.down_proj grad per expert (HF layout)",
]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("validate")
    code = main(["validate", "--quick", "--out", str(out)])
    return code, out, json.loads((out / "report.json").read_text())


def test_validate_quick_passes_and_fills_every_row(quick_run):
    code, out, data = quick_run
    assert code == EXIT_OK, [r["check"] for r in data["rows"] if r["status"] == "FAIL"]
    checks = [r["check"] for r in data["rows"]]
    for required in REQUIRED_CHECKS:
        assert any(required in c for c in checks), f"no row for {required!r}"
    for r in data["rows"]:
        assert r["status"] in ("PASS", "info"), r
        if r["metric"] in ("shape",):
            assert isinstance(r["fused"], str) and r["fused"] == r["tolerance"], r
        elif r["metric"] != "identical":
            assert isinstance(r["fused"], (int, float)) and r["fused"] == r["fused"], r  # numeric, not NaN
            assert r["eager"] is None or isinstance(r["eager"], (int, float)), r
    assert data["meta"]["dtype"] == "bfloat16" and data["meta"]["fused_backend"]
    # The profiler found the ops it attributes to each phase, on both paths.
    for r in data["rows"]:
        if r["section"].startswith("performance"):
            assert r["eager"] > 0 and r["fused"] > 0, r
    for name in (
        "report.md",
        "report.json",
        "grad_weight_per_expert.png",
        "time_breakdown.png",
        "tokens_per_expert.png",
    ):
        assert (out / name).stat().st_size > 0, name
    assert "all checks pass" in (out / "report.md").read_text()


def _drop_expert_1(x_MK: torch.Tensor, w_EKN: torch.Tensor, group_ends_E: torch.Tensor) -> torch.Tensor:
    """The eager forward, except expert 1's rows come back as zeros (a lost group)."""
    y_MN = eager_backend.forward(x_MK, w_EKN, group_ends_E)
    bounds = host_bounds(group_ends_E)
    y_MN[bounds[1] : bounds[2]] = 0
    return y_MN


@pytest.fixture
def broken_backend():
    backend = GmmBackend(
        name="test_drops_expert_1",
        devices=frozenset({"cpu"}),
        dtypes=frozenset({torch.float32, torch.bfloat16}),
        forward=_drop_expert_1,
        grad_input=eager_backend.grad_input,
        grad_weight=eager_backend.grad_weight,
    )
    register_backend(backend)
    yield backend.name
    unregister_backend(backend.name)


def test_validate_catches_a_backend_that_drops_an_experts_rows(broken_backend, tmp_path):
    code = main(
        ["validate", "--quick", "--tokens", "32", "--no-plots", "--backend", broken_backend, "--out", str(tmp_path)]
    )
    assert code == EXIT_FAIL
    rows = json.loads((tmp_path / "report.json").read_text())["rows"]
    status = {(r["section"].split(" (")[0], r["check"], r["metric"]): r["status"] for r in rows}
    failed = {k for k, s in status.items() if s == "FAIL"}
    # The grouped-matmul forward fails in every case (expert 1 has rows in all three) on both metrics...
    for case in ("uniform", "uneven", "empty"):
        assert ("grouped matmul", f"forward, {case} groups", "rel err vs float64") in failed
        assert ("grouped matmul", f"forward, {case} groups", "max abs diff fused-eager") in failed
        # ...while its backward, computed by correct kernels from the same inputs, passes.
        assert status[("grouped matmul", f"grad_input, {case} groups", "max abs diff fused-eager")] == "PASS"
    # In the block, the routed output is wrong and the shared expert is not to blame.
    assert ("routed experts in the MoE block", "routed-expert output", "rel diff fused-eager") in failed
    assert (
        "routed experts in the MoE block",
        "MoE block output (shared expert held fixed)",
        "rel diff fused-eager",
    ) in failed
    assert (
        status[
            ("routed experts in the MoE block", "shared expert held fixed (same weights, same output)", "max abs diff")
        ]
        == "PASS"
    )
    # Routing and shape checks do not involve the backend's numbers and still pass.
    assert not any(k[0] in ("routing", "shapes") for k in failed)
    per_expert = next(r for r in rows if r["check"] == "down_proj grad per expert, router's choice")
    assert per_expert["status"] == "FAIL" and "failing experts [1]" in per_expert["notes"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["validate", "--dtype", "fp8"], "invalid choice: 'fp8'"),
        (["validate", "--device", "tpu"], "invalid choice: 'tpu'"),
        (["validate", "--model", "gpt5"], "--model must be one of"),
        (["validate", "--backend", "nope"], "--backend nope: backend='nope' is not a registered backend"),
        (["validate", "--tokens", "0"], "--tokens must be >= 1"),
        (["validate", "--frobnicate"], "unrecognized arguments: --frobnicate"),
        (["train", "--config", "does/not/exist.yaml"], "cannot be read"),
        (["train", "--paths", "fused,turbo"], "--paths must be a comma-separated subset"),
        (["bench", "--suite", "everything"], "invalid choice: 'everything'"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        ([], "the following arguments are required"),
    ],
)
def test_bad_flags_exit_2_with_a_message(argv, message, capsys):
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_bad_config_in_a_subprocess_exits_2_without_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  num_experts: 8\nparallel:\n  expert_parallel_size: 3\n")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "moe_gmm.cli", "train", "--config", str(bad), "--out", str(tmp_path / "o")],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert "moe-gmm: error: parallel.expert_parallel_size: 3 must divide model.num_experts 8" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_train_runs_outside_the_repository_with_the_packaged_default_config(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    argv = ["train", "--steps", "2", "--paths", "eager", "--profile-steps", "0", "--out", "run"]
    proc = subprocess.run(
        [sys.executable, "-m", "moe_gmm.cli", *argv],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,  # no configs/ folder here
        timeout=300,
    )
    assert proc.returncode == EXIT_OK, proc.stderr
    assert (tmp_path / "run" / "losses.csv").read_text().count("\n") == 3  # header + two steps
    assert json.loads((tmp_path / "run" / "train_report.json").read_text())


def test_an_unknown_config_name_lists_the_packaged_configs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config", "tinyy", "--out", str(tmp_path / "o")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert (
        "config 'tinyy': no such file and no packaged config of that name (packaged: qwen3_5_397b, tiny, tiny_dp2_ep2)"
        in err
    )
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("command", "defaults"),
    [
        (
            "train",
            ["--config CONFIG", "(default: tiny)", "(default: out/train)", "(default: fused,eager)", "(default: 2)"],
        ),
        ("validate", ["(default: cpu)", "(default: bf16)", "(default: out/validate)", "(default: 0)"]),
        ("bench", ["(default: all)", "(default: out/bench)", "(default: fp32)", "(default: fwdbwd)"]),
    ],
)
def test_help_shows_every_default(command, defaults, capsys):
    assert main([command, "--help"]) == EXIT_OK
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal's width
    for default in defaults:
        assert default in text, (default, text)
    # Switches and unset overrides have no default worth printing.
    assert "(default: None)" not in text and "(default: False)" not in text
