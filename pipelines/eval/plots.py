"""Evaluation plots (matplotlib, Agg backend) drawn from per-method flat metrics.

    tau_speedup.png      τ and S per benchmark per method (grouped bars, 95% intervals; ± std at T > 0 without)
    slot_acceptance.png  P(draft at slot i accepted), pooled over benchmarks, one line per method
    latency.png          ms per round split into draft / select / verify / other (stacked bars)
    throughput.png       tokens/s against concurrency, one line per method (AR included)
    compare.png          `drelay compare`: replay τ per benchmark per variant, oracle τ as ticks;
                         below, τ ÷ baseline with its 95% interval as error bars

Inputs are the metric dicts of pipelines/eval/metrics.py, so plots can be redrawn from MLflow.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from drelay_model.decoding.stats import PHASES
from pipelines.common.methods import AR
from pipelines.eval.report import BENCHMARK_LABELS

PHASE_COLORS = {"draft": "#4C72B0", "select": "#DD8452", "verify": "#55A868", "other": "#8C8C8C"}


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _numbered(metrics: dict[str, float], prefix: str) -> list[tuple[int, float]]:
    out = [(int(k[len(prefix) :]), v) for k, v in metrics.items() if k.startswith(prefix) and k[len(prefix) :].isdigit()]
    return sorted(out)


def plot_tau_speedup(methods: dict[str, dict[str, float]], benchmarks: Sequence[str], path: Path, title: str) -> Path:
    """Two panels (τ, S): groups = benchmarks + Avg., one bar per speculative method."""
    plt = pyplot()
    spec = {m: v for m, v in methods.items() if m != AR}
    labels = [BENCHMARK_LABELS.get(b, b) for b in benchmarks] + ["Avg."]
    fig, axes = plt.subplots(2, 1, figsize=(max(7.0, 1.1 * len(labels) + 2), 6.5), sharex=True)
    width = 0.8 / max(len(spec), 1)
    for ax, key, ylabel in ((axes[0], "tau", "τ (tokens / round)"), (axes[1], "speedup", "S (× AR tokens/s)")):
        for i, (m, v) in enumerate(spec.items()):
            vals = [v.get(f"{b}/{key}", 0.0) for b in benchmarks] + [v.get(f"mean_{key}", 0.0)]
            errs = _error_bars(v, benchmarks, key, vals)
            xs = [j + (i - (len(spec) - 1) / 2) * width for j in range(len(labels))]
            ax.bar(xs, vals, width, yerr=errs, label=m, capsize=2)
        ref = ax.axhline(1.0, color="black", lw=0.8, ls="--", label="AR (S = τ = 1)")
        ax.set_ylim(0, 1.3 * _highest(spec, benchmarks, key))
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
    axes[1].set_xticks(range(len(labels)), labels, rotation=20)
    axes[0].legend(ncols=len(spec) + 1, fontsize=8, loc="upper left")
    axes[1].legend(handles=[ref], fontsize=8, loc="upper left")
    axes[0].set_title(title, fontsize=10)
    return save_figure(fig, path)


def _error_bars(v: dict[str, float], benchmarks: Sequence[str], key: str, vals: list[float]):
    """The 95% intervals (asymmetric; the Avg. bar's too) where the metrics carry them; otherwise
    ± std over seeds (T > 0); None when there is no spread to draw."""
    names = [f"{b}/{key}" for b in benchmarks] + [f"mean_{key}"]
    if any(f"{n}_ci_low" in v for n in names):
        lo = [max(x - v.get(f"{n}_ci_low", x), 0.0) for n, x in zip(names, vals)]
        hi = [max(v.get(f"{n}_ci_high", x) - x, 0.0) for n, x in zip(names, vals)]
        return [lo, hi]
    errs = [v.get(f"{b}/{key}_std", 0.0) for b in benchmarks] + [0.0]
    return errs if any(errs) else None


def _highest(spec: dict[str, dict[str, float]], benchmarks: Sequence[str], key: str) -> float:
    """Top of the tallest bar with its error bar (value + std, or the interval's top) or 1, for axis
    headroom above the legend."""
    names = [f"{b}/{key}" for b in benchmarks] + [f"mean_{key}"]
    tops = [max(v.get(n, 0.0) + v.get(f"{n}_std", 0.0), v.get(f"{n}_ci_high", 0.0)) for v in spec.values() for n in names]
    return max([1.0] + tops)


def plot_slot_acceptance(methods: dict[str, dict[str, float]], path: Path, title: str) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for m, v in methods.items():
        pts = _numbered(v, "slot_acceptance/")
        if m == AR or not pts:
            continue
        ax.plot([s for s, _ in pts], [a for _, a in pts], marker="o", ms=3, label=m)
    ax.set_xlabel("draft slot i")
    ax.set_ylabel("P(slot i accepted)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    return save_figure(fig, path)


def plot_latency(methods: dict[str, dict[str, float]], path: Path, title: str) -> Path:
    """Stacked ms per round by phase; the label on top gives ms per generated token (ms/round ÷ τ)."""
    plt = pyplot()
    names = list(methods)
    fig, ax = plt.subplots(figsize=(max(6.5, 1.3 * len(names) + 2), 4.5))
    bottom = [0.0] * len(names)
    for phase in PHASES:
        vals = [methods[m].get(f"ms_{phase}", 0.0) for m in names]
        ax.bar(names, vals, 0.6, bottom=bottom, label=phase, color=PHASE_COLORS[phase])
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, m in enumerate(names):
        tau = methods[m].get("mean_tau") or 1.0
        ax.text(i, bottom[i], f"{bottom[i]:.0f} ms\n{bottom[i] / tau:.0f} ms/token", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("ms per round (concurrency 1: one request)")
    ax.set_ylim(0, max(bottom + [1.0]) * 1.25)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    return save_figure(fig, path)


def plot_throughput(methods: dict[str, dict[str, float]], path: Path, title: str) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for m, v in methods.items():
        pts = _numbered(v, "throughput/c")
        if not pts:
            continue
        ax.plot([c for c, _ in pts], [t for _, t in pts], marker="o", label=m, ls="--" if m == AR else "-")
        if m != AR:
            for c, _ in pts:
                s = v.get(f"speedup/c{c}")
                if s is not None:
                    ax.annotate(f"{s:.2f}×", (c, v[f"throughput/c{c}"]), textcoords="offset points", xytext=(4, 4), fontsize=7)
    levels = sorted({c for v in methods.values() for c, _ in _numbered(v, "throughput/c")})
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.minorticks_off()
    ax.set_xlim(min(levels, default=1) / 1.5, max(levels, default=1) * 1.5)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("concurrency (simultaneous requests)")
    ax.set_ylabel("output tokens / s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    return save_figure(fig, path)


def save_figure(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_all(methods: dict[str, dict[str, float]], benchmarks: Sequence[str], out_dir: Path, title: str) -> list[Path]:
    """All four plots into `out_dir`; returns their paths."""
    title = title.replace(" — ", "\n")
    return [
        plot_tau_speedup(methods, benchmarks, out_dir / "tau_speedup.png", f"τ and speedup S per benchmark\n{title}"),
        plot_slot_acceptance(methods, out_dir / "slot_acceptance.png", f"Acceptance by draft slot\n{title}"),
        plot_latency(methods, out_dir / "latency.png", f"Latency per round by phase\n{title}"),
        plot_throughput(methods, out_dir / "throughput.png", f"Throughput vs concurrency\n{title}"),
    ]


def plot_comparison(summary, path: Path, title: str) -> Path:
    """Top: grouped bars of τ per benchmark (and the mean) per variant, each variant's oracle τ as a tick.
    Bottom: each variant's τ ÷ baseline with its 95% interval as error bars (when there is a variant
    besides the baseline)."""
    plt = pyplot()
    labels = [BENCHMARK_LABELS.get(b, b) for b in summary.benchmarks] + ["Avg."]
    variants = list(summary.metrics)
    panels = 2 if summary.intervals else 1
    fig, axes = plt.subplots(panels, 1, figsize=(max(7.0, 1.2 * len(labels) + 2), 4.2 * panels), sharex=True, squeeze=False)
    ax = axes[0][0]
    width = 0.8 / max(len(variants), 1)
    colors = {}
    for i, v in enumerate(variants):
        m = summary.metrics[v]
        taus = [m[f"{b}/tau"] for b in summary.benchmarks] + [m["mean_tau"]]
        oracle = [m[f"{b}/oracle_tau"] for b in summary.benchmarks] + [m["mean_oracle_tau"]]
        xs = [j + (i - (len(variants) - 1) / 2) * width for j in range(len(labels))]
        bars = ax.bar(xs, taus, width, label=v)
        colors[v] = bars.patches[0].get_facecolor()
        ax.scatter(xs, oracle, marker="_", s=120, color=colors[v], linewidths=2)
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_ylabel("replay τ (bars) · oracle τ (ticks)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(ncols=min(len(variants), 4), fontsize=8, loc="upper left")
    ax.set_title(title, fontsize=10)
    if summary.intervals:
        _plot_ratio_intervals(axes[1][0], summary, colors)
    axes[-1][0].set_xticks(range(len(labels)), labels, rotation=20)
    return save_figure(fig, path)


def _plot_ratio_intervals(ax, summary, colors) -> None:
    """Points at τ ÷ baseline per benchmark and for the mean, error bars spanning the 95% interval."""
    n = len(summary.intervals)
    for i, (v, iv) in enumerate(summary.intervals.items()):
        ivs = [iv.per_benchmark[b] for b in summary.benchmarks] + [iv.mean_ratio]
        xs = [j + (i - (n - 1) / 2) * (0.6 / max(n, 1)) for j in range(len(ivs))]
        points = [x.point for x in ivs]
        errs = [[max(x.point - x.low, 0.0) for x in ivs], [max(x.high - x.point, 0.0) for x in ivs]]
        ax.errorbar(xs, points, yerr=errs, fmt="o", ms=4, capsize=3, color=colors.get(v), label=f"{v} ({iv.verdict})")
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_ylabel(f"τ ÷ {summary.baseline} (95% interval)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(ncols=min(n, 4), fontsize=8, loc="best")
