"""Train-step benchmark on tiny models: rows, phases, real implementations, numerics, the fused optimizer.

No timing asserts: the timings of a shared CPU say nothing at these sizes.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from moe_gmm.bench import moe_layer
from moe_gmm.bench.harness import TimingSettings
from moe_gmm.bench.moe_layer import MoeLayerCase
from moe_gmm.bench.train_step import (
    BASELINE,
    LM_MODELS,
    PHASE_COLUMNS,
    TRAIN_IMPLS,
    TRAIN_MODES,
    LmCase,
    block_subjects,
    lm_subjects,
    profile_train_phases,
    run_train_steps,
    train_markdown,
    train_step,
)
from moe_gmm.testing import assert_rel_close
from tests.helpers.profiling import op_names

FAST = TimingSettings(warmup=0, min_repeats=1, max_repeats=1, min_seconds=0.0)
BLOCK = MoeLayerCase(num_experts=8, num_tokens=12, top_k=2, hidden=32, intermediate=16, shared_intermediate=24)
LM_IMPLS = ("hf_eager", "hf_grouped_mm", "hf_moe_gmm")


def tiny_lm(model: str) -> LmCase:
    return LmCase(
        model, num_experts=8, top_k=2, hidden=32, intermediate=16, shared_intermediate=16,
        layers=2, batch=1, seq_len=8, vocab=64, heads=2, kv_heads=1, head_dim=16,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tiny_run():
    return run_train_steps(
        [BLOCK], [tiny_lm("mixtral")], dtypes=[torch.float32], modes=list(TRAIN_MODES), settings=FAST,
        breakdown_steps=1,
    )  # fmt: skip


def test_tiny_run_has_a_row_per_model_mode_and_implementation(tiny_run):
    rows = tiny_run["rows"]
    got = {(r["model"], r["mode"], r["impl"]) for r in rows}
    want = {("block", m, n) for m in TRAIN_MODES for n in TRAIN_IMPLS}
    want |= {("mixtral", m, n) for m in TRAIN_MODES for n in LM_IMPLS}
    assert got == want
    optimizer = {"train": "AdamW for-loop", "train_fused": "AdamW fused", "grad": "none"}
    for r in rows:
        assert {"case", "dtype", "params", "median_ms", "p20_ms", "p80_ms", "repeats", "reference"} <= set(r)
        assert r["median_ms"] > 0 and r["p20_ms"] <= r["median_ms"] <= r["p80_ms"]
        assert r["optimizer"] == optimizer[r["mode"]], r
        assert r["reference"] == "hf_eager"
        # fp32: every implementation's loss and gradients within 1e-5 of transformers' eager experts
        assert r["loss_rel_err"] < 1e-5 and r["grad_rel_err"] < 1e-5, r
        speedup = r[f"speedup_vs_{BASELINE}"]
        if r["impl"] == BASELINE:
            assert speedup == 1.0
        else:
            assert speedup > 0
    text = train_markdown(tiny_run)
    assert "moe_gmm vs hf_grouped_mm" in text and "Time by phase, mixtral" in text


def test_tiny_run_splits_every_train_step_by_phase(tiny_run):
    entries = tiny_run["breakdown"]
    assert {(b["model"], b["mode"], b["impl"]) for b in entries} == {
        (r["model"], r["mode"], r["impl"]) for r in tiny_run["rows"] if r["mode"] != "grad"
    }
    for b in entries:
        ms = b["ms"]
        assert set(PHASE_COLUMNS) <= set(ms)
        for phase in ("router", "experts", "other_fwd", "backward", "optimizer"):
            assert ms[phase] > 0, (b["model"], b["impl"], phase)
        parts = ms["router"] + ms["experts"] + ms["shared_expert"] + ms["other_fwd"]
        assert parts + ms["backward"] + ms["optimizer"] + ms["zero_grad"] == pytest.approx(ms["total"])
        assert ms[ms["largest"]] == max(ms[p] for p in ("router", "experts", "shared_expert", "other_fwd",
                                                         "backward", "optimizer", "zero_grad"))  # fmt: skip
        ours = b["impl"] in ("hf_moe_gmm", "moe_gmm")
        # Our labels (inside the experts and in the backward) appear exactly where our ops run.
        assert (ms["gmm"] > 0 and ms["gmm_bwd"] > 0) == ours, b
        if b["model"] == "block":
            assert ms["shared_expert"] > 0


def test_the_implementations_really_differ():
    subjects = block_subjects(BLOCK, torch.float32, list(TRAIN_IMPLS))
    subjects.update({f"lm_{n}": s for n, s in lm_subjects(tiny_lm("qwen3_moe"), torch.float32, LM_IMPLS).items()})
    for key, s in subjects.items():
        ops = op_names(lambda s=s: train_step(s, torch.optim.AdamW(s.params, lr=1e-5)))
        uses_gmm = "moe_gmm::grouped_matmul" in ops and "moe_gmm::grouped_matmul_grad_weight" in ops
        assert uses_gmm == (s.name in ("hf_moe_gmm", "moe_gmm")), key
        if s.name in ("hf_eager", "hf_grouped_mm"):
            assert ("aten::_grouped_mm" in ops) == (s.name == "hf_grouped_mm"), key


@pytest.mark.parametrize("model", ["block", *LM_MODELS])
def test_moe_gmm_losses_and_grads_match_transformers_eager_fp32(model):
    if model == "block":
        subjects = block_subjects(BLOCK, torch.float32, ["hf_eager", "hf_moe_gmm", "moe_gmm"])
    else:
        subjects = lm_subjects(tiny_lm(model), torch.float32, ["hf_eager", "hf_moe_gmm"])
    results = {}
    for name, s in subjects.items():
        loss = s.loss()
        loss.backward()  # what training runs: gradients accumulated into .grad
        results[name] = (loss.detach(), [g.detach().clone() for g in s.grads()])
    ref_loss, ref_grads = results.pop("hf_eager")
    assert len(ref_grads) >= 7
    for name, (loss, grads) in results.items():
        assert_rel_close(loss, ref_loss, 1e-5, f"{model} {name} loss")
        for i, (g, r) in enumerate(zip(grads, ref_grads, strict=True)):
            assert_rel_close(g, r, 1e-5, f"{model} {name} grad {i}")


def test_profiled_phases_name_the_optimizer_they_ran():
    s = block_subjects(BLOCK, torch.float32, ["moe_gmm"])["moe_gmm"]
    assert profile_train_phases(s, "train_fused")["optimizer_kind"] == "AdamW fused"
    assert profile_train_phases(s, "train")["optimizer_kind"] == "AdamW for-loop"


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: run_train_steps([BLOCK], [], dtypes=[torch.float32], modes=["fwd"]), ValueError, "modes"),
        (lambda: run_train_steps([BLOCK], [], dtypes=[torch.float32], impls=["hf_sdpa"]), ValueError, "impls"),
        (lambda: LmCase("gpt2"), ValueError, "model must be one of"),
        (lambda: LmCase("mixtral", num_experts=4, top_k=8), ValueError, "top_k"),
        (lambda: LmCase("mixtral", layers=0), ValueError, "layers"),
        (lambda: lm_subjects(tiny_lm("mixtral"), torch.float32, ["moe_gmm"]), ValueError, "moe_gmm"),
        (lambda: profile_train_phases(None, "fwd"), ValueError, "mode"),
    ],
)
def test_bad_arguments_are_rejected(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize(("steps", "error"), [(0, ValueError), (1.0, TypeError), (True, TypeError)])
def test_profile_train_phases_rejects_bad_steps(steps, error):
    s = block_subjects(BLOCK, torch.float32, ["hf_grouped_mm"])["hf_grouped_mm"]
    with pytest.raises(error, match="steps"):
        profile_train_phases(s, "train", steps=steps)


def test_layer_benchmark_prints_the_train_table_first(tmp_path, capsys):
    out = tmp_path / "layer.json"
    argv = ["--quick", "--cases", "tiny", "--dtype", "fp32", "--modes", "train,fwdbwd", "--breakdown-steps", "0",
            "--train-impls", "hf_moe_gmm", "--no-progress", "--out", str(out)]  # fmt: skip
    assert moe_layer.main(argv) == 0
    printed = capsys.readouterr().out
    assert -1 < printed.index("Train step") < printed.index("MoE layer (Qwen3.5-MoE sparse block)")
    data = json.loads(out.read_text())
    assert {r["impl"] for r in data["train_step"]["rows"]} == {BASELINE, "hf_moe_gmm"}
    assert {r["mode"] for r in data["rows"]} == {"fwdbwd"}


def test_layer_benchmark_rejects_an_unknown_causal_lm():
    with pytest.raises(SystemExit, match="--lm"):
        moe_layer.main(["--cases", "tiny", "--modes", "train", "--lm", "llama", "--no-progress"])
