"""``moe-gmm train`` end to end: Ctrl-C, a second run on the same ``--out``, another run's checkpoints.

Real runs of the tiny config (eager path, a few steps): one ``python -m moe_gmm.cli`` subprocess
trains until it has a checkpoint, is refused to a second run on its folder, gets SIGINT, and its
last checkpoint must resume to the losses of an uninterrupted run.
"""

from __future__ import annotations

import csv
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from moe_gmm.cli import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, main
from moe_gmm.parallel.dcp import checkpoint_extra

REPO = Path(__file__).resolve().parents[2]
SMALL = "training:\n  steps: {steps}\n  micro_batch_size: 2\n  seq_len: 16\n  checkpoint_every: 1\nseed: {seed}\n"


def _config(tmp_path: Path, *, steps: int = 2, seed: int = 0, name: str = "c.yaml") -> str:
    path = tmp_path / name
    path.write_text(SMALL.format(steps=steps, seed=seed))
    return str(path)


def _train(config: str, out: Path, *extra: str) -> list[str]:
    return ["train", "--config", config, "--out", str(out), "--paths", "eager", "--profile-steps", "0", *extra]


def _losses(out: Path) -> list[float]:
    with (out / "losses.csv").open() as fh:
        return [float(r["loss_eager"]) for r in csv.DictReader(fh)]


def _wait_for(path: Path, proc: subprocess.Popen, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"no {path} after {timeout_s} s"
        time.sleep(0.1)


def test_ctrl_c_exits_130_naming_a_checkpoint_that_resumes_and_a_second_run_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, "-m", "moe_gmm.cli", *_train(_config(tmp_path, steps=10_000), out)]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(out / "ckpt_eager.dcp" / "manifest.json", proc)
        # A second run on the same folder while the first trains: refused, the first one named.
        assert main(_train(_config(tmp_path, steps=3, name="d.yaml"), out)) == EXIT_USAGE
        err = capsys.readouterr().err
        assert f"is in use by another moe-gmm train (pid {proc.pid})" in err, err
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == EXIT_INTERRUPTED, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    last = [line for line in stderr.splitlines() if line.strip()][-1]
    found = re.fullmatch(
        r"moe-gmm: interrupted; last complete checkpoint intact: (.*ckpt_eager\.dcp) \(step (\d+)\); "
        r"continue with --resume",
        last,
    )
    assert found, last
    step = int(found.group(2))
    assert Path(found.group(1)) == out / "ckpt_eager.dcp"
    assert checkpoint_extra(out / "ckpt_eager.dcp", ("step",)) == {"step": step}

    # The named checkpoint resumes, and the run ends where an uninterrupted one does.
    assert main(_train(_config(tmp_path, steps=step + 1), out, "--resume")) == EXIT_OK
    straight = tmp_path / "straight"
    assert main(_train(_config(tmp_path, steps=step + 1), straight)) == EXIT_OK
    assert _losses(out) == _losses(straight)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """Seed 0, two eager steps."""
    root = tmp_path_factory.mktemp("trained")
    assert main(_train(_config(root), root / "out")) == EXIT_OK
    return root / "out"


def test_resume_of_another_seed_or_config_is_refused(trained, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    assert main(_train(_config(tmp_path, steps=3, seed=1), out, "--resume")) == EXIT_USAGE
    assert "init.dcp' belongs to another run: seed 0 there, 1 here" in capsys.readouterr().err
    other = Path(_config(tmp_path, steps=3, name="lr.yaml"))
    other.write_text(other.read_text().replace("  checkpoint_every: 1\n", "  checkpoint_every: 1\n  lr: 0.01\n"))
    assert main(_train(str(other), out, "--resume")) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "the config differs in training.lr (0.001 there, 0.01 here)" in err, err


def test_a_folder_another_run_wrote_into_is_refused_on_resume(trained, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    # Another seed trains only the fused path into the same folder: init.dcp is its own now,
    # ckpt_eager.dcp still the first run's.
    seed1 = _config(tmp_path, steps=2, seed=1, name="s1.yaml")
    assert main(["train", "--config", seed1, "--out", str(out), "--paths", "fused", "--profile-steps", "0"]) == 0
    capsys.readouterr()
    assert main(_train(_config(tmp_path, steps=3, seed=1, name="s1b.yaml"), out, "--resume")) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "ckpt_eager.dcp' belongs to another run: seed 0 there, 1 here" in err, err


@pytest.mark.parametrize(("name", "make"), [("losses.csv", Path.mkdir), ("init.dcp", Path.touch)])
def test_out_names_of_the_wrong_kind_are_usage_errors(name, make, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    make(out / name)
    assert main(_train(_config(tmp_path), out)) == EXIT_USAGE
    assert f"{name} is a" in capsys.readouterr().err
    assert not (out / "ckpt_eager.dcp").exists()  # refused before anything trained
