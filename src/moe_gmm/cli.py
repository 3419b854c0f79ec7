"""``moe-gmm``: the command line. Thin: parse arguments, call the library, print, return an exit code.

Exit codes: 0 every check passed, 1 a check failed, 2 bad usage (unknown flag, bad config,
unavailable device or backend, unwritable ``--out``, unreadable ``--resume`` checkpoint, malformed
``--compare`` baseline, sizes this machine cannot allocate), 130 ``train`` stopped by Ctrl-C. Usage
errors print one line to stderr naming the flag or key, never a traceback; Ctrl-C prints one line
naming the last complete checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys
import typing
from collections.abc import Sequence

__all__ = ["EXIT_FAIL", "EXIT_OK", "EXIT_USAGE", "build_parser", "main"]

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a program stopped by Ctrl-C


class _UsageError(Exception):
    """A flag argparse refused; ``main`` prints it as the one usage line."""


class _Parser(argparse.ArgumentParser):
    # argparse prints the whole usage block before its error; the contract is one line.
    def error(self, message: str) -> typing.NoReturn:
        raise _UsageError(f"{message} (see {self.prog} --help)")


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to each option's help, unless the help already speaks of its default or
    there is none to show (an off switch, an unset override)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.default is False or "default" in text:
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    from moe_gmm.config import packaged_configs

    parser = _Parser(
        prog="moe-gmm",
        description="Validate, train and benchmark the MoE grouped-matmul operators.",
        epilog="exit codes: 0 every check passed, 1 a check failed, 2 bad usage (flag, config, device, backend)",
        formatter_class=_DefaultsFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{validate,train,bench}")

    v = sub.add_parser(
        "validate",
        help="fill the measurement table: eager vs fused, pass/fail per row",
        formatter_class=_DefaultsFormatter,
    )
    v.add_argument("--device", choices=("cpu", "cuda", "npu"), default="cpu", help="where the operators run")
    v.add_argument(
        "--dtype",
        choices=("bf16", "fp32"),
        default="bf16",
        help="bf16 (the reference unit test's dtype, rtol=atol=1e-2) or fp32 (1e-5)",
    )
    v.add_argument(
        "--model",
        default="tiny",
        help="layer sizes: tiny (default), qwen3_5_35b_layer, qwen3_5_397b_layer; the float64 references of the "
        "large layers need tens of GB of host memory",
    )
    v.add_argument("--backend", default=None, help="grouped-matmul backend of the fused path (default: automatic)")
    v.add_argument("--out", default="out/validate", help="directory for report.md, report.json and plots")
    v.add_argument("--quick", action="store_true", help="fewer tokens and timing repeats (about a minute on 2 cores)")
    v.add_argument("--seed", type=int, default=0, help="seed of the random weights and tokens")
    v.add_argument("--tokens", type=int, default=None, help="tokens per batch (default 64 with --quick, else 256)")
    v.add_argument("--no-plots", action="store_true", help="skip the PNG plots")

    t = sub.add_parser(
        "train",
        help="train a tiny Qwen3.5-MoE on the fused and the eager path; compare losses",
        formatter_class=_DefaultsFormatter,
    )
    t.add_argument(
        "--config",
        default="tiny",
        help=f"YAML run configuration: a file, or a packaged config's name ({', '.join(packaged_configs())})",
    )
    t.add_argument("--steps", type=int, default=None, help="override training.steps")
    t.add_argument("--resume", action="store_true", help="continue from the checkpoints in --out")
    t.add_argument("--out", default="out/train", help="directory for losses.csv, losses.png, report, checkpoints")
    t.add_argument("--paths", default="fused,eager", help="comma-separated subset of fused,eager to run")
    t.add_argument(
        "--profile-steps", type=int, default=2, help="extra profiled steps per path for the time breakdown (0: none)"
    )
    t.add_argument(
        "--expert-parallel-size",
        type=int,
        default=None,
        metavar="EP",
        help="override parallel.expert_parallel_size (dp becomes processes / EP), e.g. to --resume on another mesh",
    )

    b = sub.add_parser(
        "bench", help="grouped-matmul and MoE-layer benchmarks with JSON and plots", formatter_class=_DefaultsFormatter
    )
    b.add_argument("--suite", choices=("gmm", "layer", "all"), default="all", help="which benchmarks run")
    b.add_argument(
        "--out", default="out/bench", help="directory for gmm.json, moe_layer.json, their .md tables and plots"
    )
    b.add_argument("--quick", action="store_true", help="the small case sets and fewer repeats")
    b.add_argument("--dtype", choices=("bf16", "fp32"), default="fp32", help="data type of the timed cases")
    b.add_argument("--mode", choices=("fwd", "bwd", "fwdbwd"), default="fwdbwd", help="which passes are timed")
    b.add_argument(
        "--compare",
        default=None,
        metavar="BASELINE",
        help="rerun the baseline's recorded commands and print the rows improved / regressed against it "
        "(exit 1 on a regression; --quick, --dtype, --mode do not apply)",
    )
    b.add_argument("--baseline-out", default=None, metavar="FILE", help="also write the runs' rows into a baseline")
    for command in (v, t, b):
        command.add_argument(
            "--verbose", action="store_true", help="log which backend runs each layer shape (MOE_GMM_LOG=info does too)"
        )
    return parser


def _usage_error(message: str) -> int:
    one_line = " ".join(message.split())  # messages quoting a parser's error may span lines
    print(f"moe-gmm: error: {one_line}", file=sys.stderr)
    return EXIT_USAGE


def _progress(console):
    def say(message: str) -> None:
        console.print(f"[dim]- {message}[/dim]")

    return say


def _validate(args: argparse.Namespace) -> int:
    from moe_gmm.report.render import render_terminal, wide_console
    from moe_gmm.report.validate import ValidateOptions, ValidationUsageError, run_validation

    if args.tokens is not None and args.tokens < 1:
        return _usage_error(f"--tokens must be >= 1, got {args.tokens}")
    opts = ValidateOptions(
        device=args.device,
        dtype=args.dtype,
        model=args.model,
        quick=args.quick,
        backend=args.backend,
        seed=args.seed,
        num_tokens=args.tokens,
        plots=not args.no_plots,
    )
    console = wide_console()
    try:
        report, files = run_validation(opts, out_dir=args.out, progress=_progress(console))
    except ValidationUsageError as exc:
        return _usage_error(str(exc))
    render_terminal(report, console)
    for name, path in files.items():
        console.print(f"wrote {path}  [dim]({name})[/dim]")
    return EXIT_OK if report.ok else EXIT_FAIL


def _train_paths(text: str) -> tuple[str, ...] | None:
    """The paths ``--paths`` names, or None when it is not a subset of fused,eager (each path at most
    once: the report keys its results by path, so a repeat would overwrite the first run's)."""
    paths = tuple(p.strip() for p in text.split(",") if p.strip())
    if not paths or any(p not in ("fused", "eager") for p in paths) or len(set(paths)) != len(paths):
        return None
    return paths


def _check_training_fits(config, config_flag: str) -> None:
    """ValueError naming the config when its model cannot be allocated on this machine at all."""
    from moe_gmm._validation import check_fits_in_memory
    from moe_gmm.config import training_memory_bytes

    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    needed = training_memory_bytes(config, world_size=max(1, world))
    check_fits_in_memory(needed, config.device, f"--config {config_flag}: the model.* and training.* sizes")


def _train(args: argparse.Namespace) -> int:
    from moe_gmm.checksum import CheckpointError
    from moe_gmm.config import ConfigError, load_config
    from moe_gmm.report.train import TrainInterrupted, TrainUsageError, run_training

    paths = _train_paths(args.paths)
    if paths is None:
        return _usage_error(
            f"--paths must be a comma-separated subset of fused,eager, each at most once, got {args.paths!r}"
        )
    if args.steps is not None and args.steps < 1:
        return _usage_error(f"--steps must be >= 1, got {args.steps}")
    if args.profile_steps < 0:
        return _usage_error(f"--profile-steps must be >= 0, got {args.profile_steps}")
    if args.expert_parallel_size is not None and args.expert_parallel_size < 1:
        return _usage_error(f"--expert-parallel-size must be >= 1, got {args.expert_parallel_size}")
    try:
        config = load_config(args.config)
        _check_training_fits(config, args.config)
    except ValueError as exc:  # ConfigError included
        return _usage_error(str(exc))
    try:
        if args.expert_parallel_size is not None:  # checked against the model and the world in run_training
            config.parallel.expert_parallel_size = args.expert_parallel_size
            config.parallel.data_parallel_shard = None
        result = run_training(
            config,
            out_dir=args.out,
            steps=args.steps,
            resume=args.resume,
            paths=paths,
            profile_steps=args.profile_steps,
        )
    except (ConfigError, TrainUsageError, CheckpointError) as exc:
        return _usage_error(str(exc))
    except (TrainInterrupted, KeyboardInterrupt) as exc:  # the latter: before training began
        print(f"moe-gmm: {str(exc) or 'interrupted before training began; nothing saved'}", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_OK if result.ok else EXIT_FAIL


def _bench(args: argparse.Namespace) -> int:
    from moe_gmm.bench.command import SUITES, BenchUsageError, run_bench

    try:
        result = run_bench(
            out_dir=args.out,
            quick=args.quick,
            dtype=args.dtype,
            mode=args.mode,
            suites=SUITES if args.suite == "all" else (args.suite,),
            compare=args.compare,
            baseline_out=args.baseline_out,
        )
    except BenchUsageError as exc:
        return _usage_error(str(exc))
    for name, path in result.files.items():
        print(f"wrote {path}  ({name})")
    return EXIT_FAIL if result.regressed else EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    # Models are built from configs; never reach for a hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except _UsageError as exc:
        return _usage_error(str(exc))
    except SystemExit as exc:  # --help
        return EXIT_USAGE if exc.code not in (0, None) else EXIT_OK
    if args.verbose:
        from moe_gmm.log import enable_logging

        enable_logging("info")
    handler = {"validate": _validate, "train": _train, "bench": _bench}[args.command]
    try:
        return handler(args)
    except MemoryError as exc:  # sizes the checks above could not foresee; a traceback would not help
        return _usage_error(f"out of memory ({str(exc) or 'MemoryError'}); use smaller sizes")
    except RuntimeError as exc:
        if not _is_allocation_failure(exc):
            raise
        return _usage_error(f"out of memory ({str(exc)[:200]}); use smaller sizes")


def _is_allocation_failure(exc: RuntimeError) -> bool:
    """torch reports a failed allocation as OutOfMemoryError (accelerators) or a RuntimeError from
    the CPU allocator; both mean sizes too large for this machine, not a bug."""
    import torch

    return isinstance(exc, torch.OutOfMemoryError) or "can't allocate memory" in str(exc)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
