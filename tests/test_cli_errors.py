"""Hostile input to ``moe-gmm``: every bad usage exits 2 with one line naming the key, never a traceback.

Each case is classified (config value, config structure, config file, flag, output directory,
resume checkpoint) and runs through ``moe_gmm.cli.main`` in-process; a few run as a real
``python -m moe_gmm.cli`` subprocess to show that nothing else reaches the terminal. A training
case that is wrongly accepted trains one eager step, so a regression fails fast.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml

from moe_gmm.cli import EXIT_USAGE, main
from moe_gmm.ops.backends import GmmBackend, register_backend, unregister_backend
from moe_gmm.ops.backends import eager as eager_backend

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "src" / "moe_gmm" / "configs" / "tiny.yaml"
# Short enough that a wrongly accepted config trains for a moment only.
FAST = ["--steps", "1", "--paths", "eager", "--profile-steps", "0"]


def _tiny() -> dict:
    return yaml.safe_load(TINY.read_text())


def _with(dotted: str, value) -> Callable[[Path], str]:
    """A config file: tiny.yaml with ``dotted`` set to ``value`` (written as YAML)."""

    def write(tmp: Path) -> str:
        data = _tiny()
        *parents, last = dotted.split(".")
        node = data
        for p in parents:
            node = node[p]
        node[last] = value
        path = tmp / "case.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return str(path)

    return write


def _text(text: str | bytes) -> Callable[[Path], str]:
    """A config file with exactly this content."""

    def write(tmp: Path) -> str:
        path = tmp / "case.yaml"
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text)
        return str(path)

    return write


def _tiny_with_line(section: str, line: str) -> Callable[[Path], str]:
    """tiny.yaml with ``line`` added right after the ``section:`` header (raw text: duplicates survive)."""
    lines = TINY.read_text().splitlines()
    at = lines.index(f"{section}:") + 1 if section else 0
    return _text("\n".join([*lines[:at], line, *lines[at:]]) + "\n")


# (id, config writer, the key the one line must name)
CONFIG_CASES = [
    # Config values: type, range, finiteness, registry.
    ("value-gmm_backend-bogus", _with("model.gmm_backend", "bogus"), "model.gmm_backend"),
    ("value-gmm_backend-int", _with("model.gmm_backend", 3), "model.gmm_backend"),
    ("value-lr-nan", _text(TINY.read_text().replace("lr: 1.0e-3", "lr: .nan")), "training.lr"),
    ("value-lr-inf", _with("training.lr", float("inf")), "training.lr"),
    ("value-lr-negative", _with("training.lr", -1.0), "training.lr"),
    ("value-lr-zero", _with("training.lr", 0.0), "training.lr"),
    ("value-linear_key_head_dim-0", _with("model.linear_key_head_dim", 0), "model.linear_key_head_dim"),
    ("value-linear_value_head_dim-neg", _with("model.linear_value_head_dim", -1), "model.linear_value_head_dim"),
    ("value-linear_num_key_heads-0", _with("model.linear_num_key_heads", 0), "model.linear_num_key_heads"),
    ("value-linear_num_value_heads-0", _with("model.linear_num_value_heads", 0), "model.linear_num_value_heads"),
    ("value-linear_heads-indivisible", _with("model.linear_num_value_heads", 3), "model.linear_num_value_heads"),
    ("value-max_position_embeddings-0", _with("model.max_position_embeddings", 0), "model.max_position_embeddings"),
    ("value-seq_len-over-positions", _with("model.max_position_embeddings", 16), "training.seq_len"),
    ("value-grad_clip-negative", _with("training.grad_clip", -1.0), "training.grad_clip"),
    ("value-grad_clip-nan", _with("training.grad_clip", float("nan")), "training.grad_clip"),
    ("value-grad_clip-string", _with("training.grad_clip", "off"), "training.grad_clip"),
    ("value-weight_decay-negative", _with("training.weight_decay", -0.1), "training.weight_decay"),
    ("value-weight_decay-nan", _with("training.weight_decay", float("nan")), "training.weight_decay"),
    ("value-aux_loss_coef-negative", _with("model.router_aux_loss_coef", -1.0), "model.router_aux_loss_coef"),
    ("value-aux_loss_coef-inf", _with("model.router_aux_loss_coef", float("inf")), "model.router_aux_loss_coef"),
    ("value-norm_topk_prob-string", _with("model.norm_topk_prob", "no"), "model.norm_topk_prob"),
    ("value-use_gmm-int", _with("model.use_grouped_expert_matmul", 1), "model.use_grouped_expert_matmul"),
    ("value-hidden_size-bool", _with("model.hidden_size", True), "model.hidden_size"),
    ("value-hidden_size-float", _with("model.hidden_size", 64.5), "model.hidden_size"),
    ("value-hidden_size-string", _with("model.hidden_size", "64"), "model.hidden_size"),
    ("value-num_experts-0", _with("model.num_experts", 0), "model.num_experts"),
    ("value-top_k-over-E", _with("model.num_experts_per_tok", 9), "model.num_experts_per_tok"),
    ("value-kv_heads-indivisible", _with("model.num_key_value_heads", 3), "model.num_key_value_heads"),
    ("value-full_attention_interval-0", _with("model.full_attention_interval", 0), "model.full_attention_interval"),
    (
        "value-full_attention_interval-over-layers",
        _with("model.full_attention_interval", 3),
        "model.full_attention_interval",
    ),
    ("value-steps-0", _with("training.steps", 0), "training.steps"),
    ("value-micro_batch-negative", _with("training.micro_batch_size", -2), "training.micro_batch_size"),
    ("value-seq_len-0", _with("training.seq_len", 0), "training.seq_len"),
    ("value-checkpoint_every-negative", _with("training.checkpoint_every", -1), "training.checkpoint_every"),
    ("value-seed-negative", _with("seed", -1), "seed"),
    ("value-seed-huge", _with("seed", 2**70), "seed"),
    ("value-dtype-fp16", _with("dtype", "fp16"), "dtype"),
    ("value-device-tpu", _with("device", "tpu"), "device"),
    ("value-device-npu-absent", _with("device", "npu"), "device"),
    ("value-model_id-llama", _with("model.model_id", "llama"), "model.model_id"),
    ("value-ep-indivisible", _with("parallel.expert_parallel_size", 3), "parallel.expert_parallel_size"),
    ("value-ep-without-torchrun", _with("parallel.expert_parallel_size", 2), "parallel.expert_parallel_size"),
    ("value-dispatcher-bogus", _with("parallel.ep_plan.dispatcher", "pigeon"), "parallel.ep_plan.dispatcher"),
    ("value-num_chunks-0", _with("parallel.ep_plan.num_chunks", 0), "parallel.ep_plan.num_chunks"),
    (
        "value-apply_modules-string",
        _with("parallel.ep_plan.apply_modules", "model.x"),
        "parallel.ep_plan.apply_modules",
    ),
    # Config structure: unknown and duplicate keys, wrong nesting.
    ("structure-unknown-model-key", _with("model.hiden_size", 64), "model.hiden_size"),
    ("structure-unknown-top-key", _with("trainig", {}), "trainig"),
    ("structure-duplicate-model-key", _tiny_with_line("model", "  hidden_size: 32"), "model.hidden_size"),
    ("structure-duplicate-section", _text(TINY.read_text() + "training:\n  steps: 3\n"), "training"),
    (
        "structure-duplicate-ep_plan-key",
        _tiny_with_line("parallel", "  expert_parallel_size: 1"),
        "parallel.expert_parallel_size",
    ),
    ("structure-duplicate-top-scalar", _tiny_with_line("", "seed: 5"), "seed"),
    ("structure-section-scalar", _with("training", 5), "training"),
    ("structure-top-level-list", _text("- 1\n- 2\n"), "<top level>"),
    # Config file: unreadable, not YAML, unsafe YAML.
    ("file-missing", lambda tmp: str(tmp / "nope.yaml"), "nope.yaml"),
    ("file-directory", lambda tmp: str(tmp), "config file"),
    ("file-not-utf8", _text(b"seed: \xff\xfe\n"), "config file"),
    ("file-bad-yaml", _text("model: [unclosed\n"), "config file"),
    ("file-python-tag", _text("seed: !!python/object/apply:os.getpid []\n"), "config file"),
]


def _one_usage_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    assert lines[0].startswith("moe-gmm: error: "), lines[0]
    return lines[0]


def _run_main(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except BaseException as exc:  # noqa: BLE001 - an escaping exception is what this file hunts for
        pytest.fail(f"main({argv}) raised {type(exc).__name__}: {exc}")
    return code, capsys.readouterr().err


@pytest.mark.parametrize(("case", "write", "key"), CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_bad_config_exits_2_with_one_line_naming_the_key(case, write, key, tmp_path, capsys):
    argv = ["train", "--config", write(tmp_path), "--out", str(tmp_path / "out"), *FAST]
    code, err = _run_main(argv, capsys)
    assert code == EXIT_USAGE, (case, err)
    assert key in _one_usage_line(err)


@pytest.fixture
def fp32_only_backend():
    """A registered backend that runs float32 only: a bf16 run must be refused before step 1."""
    backend = GmmBackend(
        name="test_fp32_only",
        devices=frozenset({"cpu"}),
        dtypes=frozenset({torch.float32}),
        forward=eager_backend.forward,
        grad_input=eager_backend.grad_input,
        grad_weight=eager_backend.grad_weight,
    )
    register_backend(backend)
    yield backend.name
    unregister_backend(backend.name)


def test_a_backend_that_cannot_run_the_configured_dtype_is_a_usage_error(fp32_only_backend, tmp_path, capsys):
    text = TINY.read_text().replace("gmm_backend: null", f"gmm_backend: {fp32_only_backend}")
    config = _text(text.replace("dtype: fp32", "dtype: bf16"))(tmp_path)
    code, err = _run_main(["train", "--config", config, "--out", str(tmp_path / "o"), *FAST[:2]], capsys)
    assert code == EXIT_USAGE, err
    line = _one_usage_line(err)
    assert "model.gmm_backend: backend='test_fp32_only' cannot run these inputs: dtype bfloat16" in line


def _a_file(tmp: Path) -> Path:
    path = tmp / "a_file"
    path.write_text("not a directory\n")
    return path


FLAG_CASES = [
    ("flag-train-steps-0", lambda tmp: ["train", "--steps", "0"], "--steps"),
    ("flag-train-steps-text", lambda tmp: ["train", "--steps", "many"], "--steps"),
    ("flag-train-paths", lambda tmp: ["train", "--paths", "fused,turbo"], "--paths"),
    ("flag-train-profile-negative", lambda tmp: ["train", "--profile-steps", "-1"], "--profile-steps"),
    ("flag-train-unknown", lambda tmp: ["train", "--frobnicate"], "--frobnicate"),
    ("flag-validate-tokens-0", lambda tmp: ["validate", "--tokens", "0"], "--tokens"),
    ("flag-validate-backend", lambda tmp: ["validate", "--backend", "nope"], "--backend"),
    ("flag-validate-dtype", lambda tmp: ["validate", "--dtype", "fp8"], "--dtype"),
    ("flag-validate-model", lambda tmp: ["validate", "--model", "gpt5"], "--model"),
    ("flag-validate-seed-negative", lambda tmp: ["validate", "--seed", "-1"], "--seed"),
    ("flag-command-unknown", lambda tmp: ["frobnicate"], "frobnicate"),
    ("flag-command-missing", lambda tmp: [], "{validate,train,bench}"),
    # Output directories that cannot be written: checked before any work.
    ("out-train-under-a-file", lambda tmp: ["train", "--out", str(_a_file(tmp) / "sub"), *FAST], "--out"),
    ("out-train-is-a-file", lambda tmp: ["train", "--out", str(_a_file(tmp)), *FAST], "--out"),
    (
        "out-validate-under-a-file",
        lambda tmp: ["validate", "--quick", "--no-plots", "--tokens", "8", "--out", str(_a_file(tmp) / "x")],
        "--out",
    ),
    (
        "out-validate-is-a-file",
        lambda tmp: ["validate", "--quick", "--no-plots", "--tokens", "8", "--out", str(_a_file(tmp))],
        "--out",
    ),
]


@pytest.mark.parametrize(("case", "argv", "key"), FLAG_CASES, ids=[c[0] for c in FLAG_CASES])
def test_bad_flag_exits_2_with_one_line_naming_it(case, argv, key, tmp_path, capsys):
    code, err = _run_main(argv(tmp_path), capsys)
    assert code == EXIT_USAGE, (case, err)
    assert key in _one_usage_line(err)


# ----------------------------------------------------------------------------------------------
# --resume: a real one-step run's checkpoint, then damaged
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("trained")
    # Two steps: the report's "loss decreases" row needs a first and a last loss to differ.
    argv = ["train", "--config", str(TINY), "--out", str(out), "--steps", "2", "--paths", "eager"]
    assert main([*argv, "--profile-steps", "0"]) == 0
    return out


def _flip_byte(path: Path, at_fraction: float) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at_fraction)] ^= 0x40
    path.write_bytes(bytes(data))


def _edit_state(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    """Rewrite the eager checkpoint's DCP files with ``edit`` applied (its manifest no longer matches)."""

    def damage(out: Path) -> None:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

        path = out / "ckpt_eager.dcp"
        dcp_to_torch_save(path, out / "state.pt")
        state = torch.load(out / "state.pt", weights_only=False)
        edit(state)
        torch.save(state, out / "state.pt")
        for name in (".metadata", "__0_0.distcp"):
            (path / name).unlink()
        torch_save_to_dcp(out / "state.pt", path)

    return damage


def _first_weight(state: dict) -> str:
    return next(k for k in state["model"] if k.endswith("weight"))


def _nan_into_a_weight(state: dict) -> None:
    state["model"][_first_weight(state)].view(-1)[0] = float("nan")


def _scale_a_weight(state: dict) -> None:
    state["model"][_first_weight(state)].mul_(1.0001)


def _drop_a_weight(state: dict) -> None:
    del state["model"][_first_weight(state)]


def _reshape_a_weight(state: dict) -> None:
    key = _first_weight(state)
    state["model"][key] = state["model"][key][:1].clone()


def _forge_the_step(state: dict) -> None:
    state["extra"]["step"] = state["extra"]["step"] - 1
    state["extra"]["losses"] = state["extra"]["losses"][:-1]
    state["extra"]["step_ms"] = state["extra"]["step_ms"][:-1]


SHARD = "ckpt_eager.dcp/__0_0.distcp"
RESUME_CASES = [
    ("resume-nothing-there", lambda out: shutil.rmtree(out), "--resume"),
    ("resume-ckpt-missing", lambda out: shutil.rmtree(out / "ckpt_eager.dcp"), "ckpt_eager.dcp"),
    ("resume-ckpt-a-file", lambda out: _replace_by_a_file(out / "ckpt_eager.dcp"), "ckpt_eager.dcp"),
    ("resume-shard-garbage", lambda out: (out / SHARD).write_bytes(b"\x00garbage" * 64), "__0_0.distcp"),
    ("resume-shard-empty", lambda out: (out / SHARD).write_bytes(b""), "__0_0.distcp"),
    ("resume-shard-truncated", lambda out: (out / SHARD).write_bytes((out / SHARD).read_bytes()[:999]), "__0_0.distcp"),
    ("resume-shard-flipped-byte", lambda out: _flip_byte(out / SHARD, 0.6), "__0_0.distcp"),
    ("resume-metadata-flipped-byte", lambda out: _flip_byte(out / "ckpt_eager.dcp/.metadata", 0.5), ".metadata"),
    ("resume-manifest-flipped-byte", lambda out: _flip_byte(out / "ckpt_eager.dcp/manifest.json", 0.5), "manifest"),
    ("resume-manifest-missing", lambda out: (out / "ckpt_eager.dcp/manifest.json").unlink(), "manifest.json"),
    ("resume-ckpt-nan-injected", _edit_state(_nan_into_a_weight), "ckpt_eager.dcp"),
    ("resume-ckpt-weight-changed", _edit_state(_scale_a_weight), "ckpt_eager.dcp"),
    ("resume-ckpt-tensor-missing", _edit_state(_drop_a_weight), "ckpt_eager.dcp"),
    ("resume-ckpt-wrong-shape", _edit_state(_reshape_a_weight), "ckpt_eager.dcp"),
    ("resume-ckpt-step-forged", _edit_state(_forge_the_step), "ckpt_eager.dcp"),
    ("resume-init-missing", lambda out: shutil.rmtree(out / "init.dcp"), "init.dcp"),
    ("resume-init-flipped-byte", lambda out: _flip_byte(out / "init.dcp/__0_0.distcp", 0.7), "init.dcp"),
]


def _replace_by_a_file(path: Path) -> None:
    shutil.rmtree(path)
    path.write_bytes(b"PK\x03\x04 nope")


@pytest.mark.parametrize(("case", "damage", "key"), RESUME_CASES, ids=[c[0] for c in RESUME_CASES])
def test_damaged_resume_exits_2_with_one_line_naming_the_file(case, damage, key, trained, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    damage(out)
    argv = ["train", "--config", str(TINY), "--out", str(out), "--resume", "--steps", "3", "--paths", "eager"]
    code, err = _run_main([*argv, "--profile-steps", "0"], capsys)
    assert code == EXIT_USAGE, (case, err)
    assert key in _one_usage_line(err)


def test_resume_already_done_is_a_usage_error(trained, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    argv = ["train", "--config", str(TINY), "--out", str(out), "--resume", "--steps", "2", "--paths", "eager"]
    code, err = _run_main(argv, capsys)
    assert code == EXIT_USAGE
    assert "--steps" in _one_usage_line(err)


def test_intact_resume_continues(trained, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    argv = ["train", "--config", str(TINY), "--out", str(out), "--resume", "--steps", "3", "--paths", "eager"]
    code, _ = _run_main([*argv, "--profile-steps", "0"], capsys)
    assert code == 0
    from moe_gmm.parallel.dcp import checkpoint_extra

    assert len(checkpoint_extra(out / "ckpt_eager.dcp", ("losses",))["losses"]) == 3


# ----------------------------------------------------------------------------------------------
# A real terminal: nothing but the one line on stderr
# ----------------------------------------------------------------------------------------------


def _cli(argv: list[str], extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1", **(extra_env or {})}
    return subprocess.run(
        [sys.executable, "-m", "moe_gmm.cli", *argv], check=False, capture_output=True, text=True, env=env, timeout=120
    )


def test_subprocess_bad_values_print_one_line(tmp_path):
    config = _text(TINY.read_text().replace("gmm_backend: null", "gmm_backend: bogus"))
    proc = _cli(["train", "--config", config(tmp_path), "--out", str(tmp_path / "o"), *FAST])
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert "model.gmm_backend" in _one_usage_line(proc.stderr)


def test_subprocess_unwritable_out_and_bad_flag_print_one_line(tmp_path):
    proc = _cli(["train", "--out", str(_a_file(tmp_path) / "sub"), *FAST])
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert "--out" in _one_usage_line(proc.stderr)
    proc = _cli(["train", "--steps", "many"])
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert "--steps" in _one_usage_line(proc.stderr)


def test_subprocess_corrupted_resume_prints_one_line(trained, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    _flip_byte(out / SHARD, 0.6)
    proc = _cli(["train", "--config", str(TINY), "--out", str(out), "--resume", "--steps", "3", "--paths", "eager"])
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert "ckpt_eager.dcp', file __0_0.distcp" in _one_usage_line(proc.stderr)


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--config", str(TINY), *FAST[:2]],
        ["validate", "--quick", "--no-plots", "--tokens", "8"],
    ],
    ids=["env-backend-train", "env-backend-validate"],
)
def test_a_bad_backend_environment_variable_is_a_usage_error(argv, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("MOE_GMM_BACKEND", "bogus")
    code, err = _run_main([*argv, "--out", str(tmp_path / "o")], capsys)
    assert code == EXIT_USAGE, err
    assert "$MOE_GMM_BACKEND: backend='bogus' is not a registered backend" in _one_usage_line(err)


# ----------------------------------------------------------------------------------------------
# Hostile usage through a real terminal: exit 2, exactly one short stderr line, no traceback
# ----------------------------------------------------------------------------------------------

_ALIAS_BOMB = "seed:\n  - &a [1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + "".join(
    f"  - &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi", strict=True)
)


def _baseline(body: str) -> Callable[[Path], str]:
    """A --compare file: a baseline of the right format whose other fields are ``body``."""

    def write(tmp: Path) -> str:
        path = tmp / "baseline.json"
        path.write_text('{"format": "moe-gmm-baseline/1", ' + body + "}")
        return str(path)

    return write


def _deep_json(tmp: Path) -> str:
    path = tmp / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    return str(path)


def _train_with(write: Callable[[Path], str]) -> Callable[[Path], list[str]]:
    return lambda tmp: ["train", "--config", write(tmp), "--out", str(tmp / "o"), *FAST]


def _compare(write: Callable[[Path], str]) -> Callable[[Path], list[str]]:
    return lambda tmp: ["bench", "--compare", write(tmp), "--out", str(tmp / "o")]


_QUICK_GMM = ["bench", "--quick", "--suite", "gmm"]

# (id, argv from a temporary folder, extra environment, what the one line must name)
TERMINAL_CASES = [
    ("train-paths-repeated", lambda tmp: ["train", "--paths", "fused,fused", "--out", str(tmp / "o")], {}, "--paths"),
    ("bench-out-is-a-file", lambda tmp: [*_QUICK_GMM, "--out", str(_a_file(tmp))], {}, "--out"),
    ("bench-out-dev-null", lambda tmp: [*_QUICK_GMM, "--out", "/dev/null"], {}, "--out"),
    ("bench-out-unwritable-mount", lambda tmp: [*_QUICK_GMM, "--out", "/proc/moe_gmm_out"], {}, "--out"),
    (
        "bench-backend-variable",
        lambda tmp: [*_QUICK_GMM, "--out", str(tmp)],
        {"MOE_GMM_BACKEND": "bogus"},
        "$MOE_GMM_BACKEND",
    ),
    ("compare-rows-not-a-list", _compare(_baseline('"rows": 5')), {}, "'rows' must be a list"),
    ("compare-run-without-command", _compare(_baseline('"rows": [], "runs": {"gmm": {}}')), {}, "runs.gmm.command"),
    ("compare-command-not-text", _compare(_baseline('"rows": [], "runs": {"gmm": {"command": 3}}')), {}, "runs.gmm"),
    ("compare-row-not-an-object", _compare(_baseline('"rows": [5], "runs": {}')), {}, "rows[0]"),
    ("compare-runs-a-list", _compare(_baseline('"rows": [], "runs": []')), {}, "'runs' must be an object"),
    ("compare-nested-too-deep", _compare(_deep_json), {}, "--compare"),
    (
        "validate-tokens-unallocatable",
        lambda tmp: ["validate", "--tokens", str(10**9), "--out", str(tmp)],
        {},
        "--tokens",
    ),
    ("config-hidden-size-unallocatable", _train_with(_with("model.hidden_size", 10**8)), {}, "--config"),
    ("config-seq-len-1", _train_with(_with("training.seq_len", 1)), {}, "training.seq_len"),
    ("config-vocab-size-1", _train_with(_with("model.vocab_size", 1)), {}, "model.vocab_size"),
    ("config-alias-bomb", _train_with(_text(_ALIAS_BOMB)), {}, "expands to more than"),
    ("config-alias-cycle", _train_with(_text("seed: &a [*a]\n")), {}, "alias refers to its own anchor"),
    ("config-dev-zero", _train_with(lambda tmp: "/dev/zero"), {}, "/dev/zero"),
    ("config-nested-too-deep", _train_with(_text(f"seed: {'[' * 50_000}{']' * 50_000}\n")), {}, "nested too deeply"),
    ("config-huge-value", _train_with(_with("model.gmm_backend", "x" * 100_000)), {}, "model.gmm_backend"),
    ("config-huge-key", _train_with(_with("model." + "k" * 100_000, 1)), {}, "unknown key"),
]


@pytest.mark.parametrize(("case", "argv", "env", "key"), TERMINAL_CASES, ids=[c[0] for c in TERMINAL_CASES])
def test_hostile_usage_in_a_terminal_is_one_line_and_exit_2(case, argv, env, key, tmp_path):
    proc = _cli(argv(tmp_path), env)
    assert proc.returncode == EXIT_USAGE, (case, proc.stderr[-2000:])
    line = _one_usage_line(proc.stderr)
    assert key in line, line
    assert len(line) < 1000, f"{case}: the message formats a whole value ({len(line)} characters)"
