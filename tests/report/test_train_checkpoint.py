"""What keeps ``--out`` one run's: identity, lock, file kinds, and Ctrl-C held while a save runs."""

from __future__ import annotations

import dataclasses
import os
import signal

import pytest

from moe_gmm.config import ParallelConfig, RunConfig, TrainingConfig
from moe_gmm.report.train_checkpoint import (
    LOCK_FILE,
    OutDirError,
    check_out_kinds,
    check_run_identity,
    deferred_interrupt,
    lock_out_dir,
    run_identity,
)


def test_identity_ignores_the_mesh_and_the_length_and_names_what_differs():
    cfg = RunConfig()
    saved = run_identity(cfg)
    resumable = dataclasses.replace(
        cfg, parallel=ParallelConfig(expert_parallel_size=2), training=TrainingConfig(steps=99, checkpoint_every=3)
    )
    assert check_run_identity(saved, resumable, "ckpt") is None
    assert check_run_identity(saved, dataclasses.replace(cfg, seed=1), "ckpt") == (
        "ckpt belongs to another run: seed 0 there, 1 here"
    )
    other_lr = dataclasses.replace(cfg, training=TrainingConfig(lr=2e-3))
    assert check_run_identity(saved, other_lr, "ckpt") == (
        "ckpt belongs to another run: the config differs in training.lr (0.001 there, 0.002 here)"
    )
    assert "carries no run identity" in check_run_identity(None, cfg, "ckpt")
    assert "carries no run identity" in check_run_identity('{"seed": 0}', cfg, "ckpt")


def test_a_held_lock_refuses_a_second_holder_naming_the_first(tmp_path):
    with lock_out_dir(tmp_path):
        # flock belongs to an open file: a second open in this very process is refused like another run.
        with pytest.raises(OutDirError, match=rf"is in use by another moe-gmm train \(pid {os.getpid()}\)"):
            with lock_out_dir(tmp_path):
                pass
    with lock_out_dir(tmp_path):  # released on exit
        pass


def test_a_lock_file_left_by_a_dead_run_is_not_a_lock(tmp_path):
    (tmp_path / LOCK_FILE).write_text("4194303\n")  # no flock held on it: whoever wrote it is gone
    with lock_out_dir(tmp_path):
        assert (tmp_path / LOCK_FILE).read_text() == f"{os.getpid()}\n"


def test_names_of_the_wrong_kind_are_refused(tmp_path):
    (tmp_path / "losses.csv").mkdir()
    (tmp_path / "init.dcp").write_text("")
    with pytest.raises(OutDirError, match=r"losses\.csv is a directory; the run writes a file there"):
        check_out_kinds(tmp_path, ("losses.csv",), ("init.dcp",))
    with pytest.raises(OutDirError, match=r"init\.dcp is a file; the run writes a checkpoint directory there"):
        check_out_kinds(tmp_path, ("absent.csv",), ("init.dcp",))
    check_out_kinds(tmp_path, ("absent.csv",), ("absent.dcp",))


def test_ctrl_c_inside_a_save_waits_for_its_end():
    finished = []
    previous = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with deferred_interrupt():
            os.kill(os.getpid(), signal.SIGINT)
            finished.append(True)  # reached: the signal did not cut the block
    assert finished == [True]
    assert signal.getsignal(signal.SIGINT) is previous
    with deferred_interrupt():  # no signal: nothing raised
        pass
