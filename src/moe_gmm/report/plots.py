"""PNG plots with matplotlib's Agg backend (no display needed).

Each function takes plain data, writes one PNG and returns its path. matplotlib is imported
lazily so that ``moe-gmm`` works without it (the caller skips the plots and says so).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = [
    "plot_bench_roofline",
    "plot_bench_times",
    "plot_grad_weight_errors",
    "plot_loss_curves",
    "plot_time_breakdown",
    "plot_tokens_per_expert",
]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def plot_grad_weight_errors(
    per_expert: Mapping[str, Sequence[float]], counts_E: Sequence[int], tolerance: float, path: str | Path
) -> Path:
    """Bars of max |grad_weight fused - eager| per expert, one group per weight; empty experts marked."""
    plt = _pyplot()
    num_experts = len(counts_E)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * num_experts + 2), 3.6))
    width = 0.8 / max(1, len(per_expert))
    for i, (name, errs) in enumerate(per_expert.items()):
        xs = [e + (i - (len(per_expert) - 1) / 2) * width for e in range(num_experts)]
        # A zero bar would vanish on a log axis; draw it at a floor value and label it below.
        ax.bar(xs, [max(v, 1e-12) for v in errs], width=width, label=name)
    ax.axhline(tolerance, color="red", linestyle="--", linewidth=1, label=f"atol {tolerance:g}")
    ax.set_yscale("log")
    ax.set_xticks(range(num_experts))
    ax.set_xticklabels([f"{e}\n({c})" for e, c in enumerate(counts_E)], fontsize=7)
    ax.set_xlabel("expert (rows routed to it)")
    ax.set_ylabel("max |fused - eager|")
    ax.set_title("grad_weight difference per expert (bars at 1e-12 are exactly 0)")
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_time_breakdown(times_ms: Mapping[str, Mapping[str, float]], path: str | Path) -> Path:
    """Grouped bars: for each phase (GMM, permute/unpermute, host, step), eager vs fused in ms."""
    plt = _pyplot()
    phases = list(next(iter(times_ms.values())).keys()) if times_ms else []
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / max(1, len(times_ms))
    for i, (path_name, by_phase) in enumerate(times_ms.items()):
        xs = [p + (i - (len(times_ms) - 1) / 2) * width for p in range(len(phases))]
        ax.bar(xs, [by_phase.get(ph, 0.0) for ph in phases], width=width, label=path_name)
    ax.set_xticks(range(len(phases)))
    ax.set_xticklabels(phases, fontsize=8)
    ax.set_ylabel("ms per step")
    ax.set_title("time breakdown, eager vs fused")
    ax.legend()
    return _save(fig, path)


def plot_tokens_per_expert(counts_E: Sequence[int], path: str | Path, title: str = "tokens per expert") -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5.0, 0.35 * len(counts_E) + 2), 3.2))
    mean = sum(counts_E) / max(1, len(counts_E))
    ax.bar(range(len(counts_E)), counts_E, color="tab:blue")
    ax.axhline(mean, color="black", linestyle=":", linewidth=1, label=f"mean {mean:.1f}")
    ax.set_xlabel("expert")
    ax.set_ylabel("routed rows")
    ax.set_title(title)
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_loss_curves(losses: Mapping[str, Sequence[float]], path: str | Path) -> Path:
    """Loss per step for each path (top) and |fused - eager| per step (bottom) when both exist."""
    plt = _pyplot()
    fig, (ax, ax_diff) = plt.subplots(2, 1, figsize=(7, 5), sharex=True, height_ratios=(3, 1.4))
    for name, curve in losses.items():
        ax.plot(range(1, len(curve) + 1), curve, marker=".", label=name)
    ax.set_ylabel("loss")
    ax.set_title("training loss")
    ax.legend()
    if "fused" in losses and "eager" in losses:
        diffs = [abs(a - b) for a, b in zip(losses["fused"], losses["eager"])]
        ax_diff.plot(range(1, len(diffs) + 1), [max(d, 1e-12) for d in diffs], color="tab:red", marker=".")
        ax_diff.set_yscale("log")
    ax_diff.set_ylabel("|fused - eager|")
    ax_diff.set_xlabel("step")
    return _save(fig, path)


def plot_bench_times(series: Mapping[str, Sequence[tuple[float, float, float]]], path: str | Path, xlabel: str) -> Path:
    """Two scatter panels against ``x``: median ms, and achieved GFLOP/s; points are (x, ms, GFLOP/s).

    Cases of different shapes share an x value, so points are not joined by lines.
    """
    plt = _pyplot()
    fig, (ax_t, ax_r) = plt.subplots(1, 2, figsize=(11, 4))
    markers = "osD^v<>ph*"
    for i, (name, points) in enumerate(series.items()):
        xs = [p[0] for p in points]
        ax_t.scatter(xs, [p[1] for p in points], marker=markers[i % len(markers)], label=name, alpha=0.8)
        ax_r.scatter(xs, [p[2] for p in points], marker=markers[i % len(markers)], label=name, alpha=0.8)
    for ax, ylabel in ((ax_t, "median ms"), (ax_r, "achieved GFLOP/s")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
    ax_t.set_title("time per case")
    ax_r.set_title("achieved throughput")
    ax_r.legend(fontsize=7)
    return _save(fig, path)


def plot_bench_roofline(
    achieved: Mapping[str, Sequence[tuple[str, float]]], peak: float | None, path: str | Path, unit: str = "GFLOP/s"
) -> Path:
    """Bars of achieved throughput per case and implementation, with the measured peak as a line."""
    plt = _pyplot()
    cases = sorted({c for pts in achieved.values() for c, _ in pts}, key=str)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.6 * len(cases) + 2), 4))
    width = 0.8 / max(1, len(achieved))
    for i, (name, points) in enumerate(achieved.items()):
        lookup = dict(points)
        xs = [c + (i - (len(achieved) - 1) / 2) * width for c in range(len(cases))]
        ax.bar(xs, [lookup.get(c, 0.0) for c in cases], width=width, label=name)
    if peak:
        ax.axhline(peak, color="red", linestyle="--", label=f"measured peak {peak:.3g}")
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels(cases, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel(unit)
    ax.set_title("achieved vs roofline")
    ax.legend(fontsize=8)
    return _save(fig, path)
