"""How far does CPU time take τ? Held-out validation τ against cumulative training wall time, over a
chain of training runs that each start from the one before (a study's `drafter.init_checkpoint`).

    .venv/bin/python analysis/plot_training_budget.py \
        --runs smollm2-135m-base smollm2-135m-joint smollm2-135m-joint-full [--out outputs/training_budget.png]

Reads each run's `val/tau_native`, `val/tau_selector` and `val/tau_oracle` from MLflow (the latest
FINISHED run of that name in --experiment). A point's x is the wall time from the start of its run
plus the whole wall time of the runs before it, so set-up and validation count as spent budget.
Prints the table, draws the plot with the --budget and --goal lines, and logs the PNG as an artifact
of the last run.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SERIES = {"val/tau_native": "native", "val/tau_selector": "DRelay selector", "val/tau_oracle": "oracle (pool)"}


@dataclass(frozen=True)
class BudgetPoint:
    run: str
    step: int
    minutes: float  # cumulative training wall time at this validation
    tau: dict[str, float]  # series name (a key of SERIES) -> τ


def run_starts(runs) -> dict[str, float]:
    """Cumulative minutes at which each run of the chain begins: the whole wall time of those before."""
    starts, offset = {}, 0.0
    for name, start, end, *_ in runs:
        starts[name], offset = offset, offset + (end - start) / 60e3
    return starts


def budget_points(runs: list[tuple[str, int, int, dict[str, list[tuple[int, int, float]]]]]) -> list[BudgetPoint]:
    """runs: (name, start_ms, end_ms, {metric: [(step, timestamp_ms, value), ...]}) in chain order."""
    out, starts = [], run_starts(runs)
    for name, start, _, history in runs:
        steps = sorted({s for series in history.values() for s, _, _ in series})
        for step in steps:
            at = {m: (t, v) for m, series in history.items() for s, t, v in series if s == step}
            stamp = max(t for t, _ in at.values())
            out.append(BudgetPoint(name, step, starts[name] + (stamp - start) / 60e3, {m: v for m, (_, v) in at.items()}))
    return out


def load_runs(client, experiment: str, names: list[str]):
    from drelay_model.errors import DRelayError

    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise DRelayError(f"--experiment: no MLflow experiment '{experiment}' at {client.tracking_uri}")
    runs = []
    for name in names:
        found = client.search_runs(
            [exp.experiment_id], f"tags.mlflow.runName = '{name}' and attributes.status = 'FINISHED'", order_by=["attributes.start_time DESC"], max_results=1
        )  # fmt: skip
        if not found:
            raise DRelayError(f"--runs: no finished MLflow run named '{name}' in experiment '{experiment}'")
        run = found[0]
        history = {m: [(h.step, h.timestamp, h.value) for h in client.get_metric_history(run.info.run_id, m)] for m in SERIES}
        runs.append((name, run.info.start_time, run.info.end_time, {m: h for m, h in history.items() if h}, run.info.run_id))
    return runs


def plot(points: list[BudgetPoint], starts: dict[str, float], path: Path, *, budget: float, goal: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for metric, label in SERIES.items():
        xy = [(p.minutes, p.tau[metric]) for p in points if metric in p.tau]
        if xy:
            ax.plot(*zip(*xy), marker="o", label=label)
    ax.axvline(budget, color="#8C8C8C", linestyle="--", linewidth=1, label=f"{budget:g}-min budget")
    ax.axhline(goal, color="#C44E52", linestyle=":", linewidth=1, label=f"goal τ = {goal:g}")
    for name, start in starts.items():  # where each run of the chain begins
        ax.axvline(start, color="#CCCCCC", linewidth=0.8)
        ax.annotate(name, (start, 0.01), xycoords=("data", "axes fraction"), xytext=(3, 0), textcoords="offset points",
                    fontsize=7, rotation=90, va="bottom", color="#555555")  # fmt: skip
    ax.set_xlabel("cumulative training wall time (min)")
    ax.set_ylabel("held-out replay τ (tokens / round)")
    ax.set_title("Validation τ against CPU training time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", required=True, metavar="NAME", help="MLflow run names, in chain order")
    p.add_argument("--experiment", default="drelay-train")
    p.add_argument("--out", default=str(ROOT / "outputs/training_budget.png"), help="PNG to write")
    p.add_argument("--budget", type=float, default=120.0, help="training budget in minutes (a vertical line)")
    p.add_argument("--goal", type=float, default=2.0, help="goal τ (a horizontal line)")
    args = p.parse_args()

    from pipelines.common.tracking import get_client

    client = get_client()
    runs = load_runs(client, args.experiment, args.runs)
    points = budget_points([r[:4] for r in runs])
    print("run | step | minutes | " + " | ".join(f"τ {label}" for label in SERIES.values()))
    for pt in points:
        cells = " | ".join(f"{pt.tau[m]:.3f}" if m in pt.tau else "—" for m in SERIES)
        print(f"{pt.run} | {pt.step} | {pt.minutes:.1f} | {cells}")
    out = Path(args.out)
    plot(points, run_starts(runs), out, budget=args.budget, goal=args.goal)
    client.log_artifact(runs[-1][4], str(out))
    print(f"wrote {out} (also logged to MLflow run {runs[-1][4]} of '{args.runs[-1]}')")


if __name__ == "__main__":
    from cli import guarded

    raise SystemExit(guarded(main, Path(__file__).name))
