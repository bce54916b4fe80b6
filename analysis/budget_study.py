"""The drafter budget study's report: held-out τ against CPU hours for every run of a study, a fitted
curve per run, and the projected speedup at the total budget, weighing τ against each drafter's
draft cost.

    .venv/bin/python analysis/budget_study.py [--spec platform/studies/smollm2-135m-budget.yaml]
        [--hours 8] [--start-hours 0] [--measure-costs] [--out docs/img/budget_study.png] [--log-mlflow]

Curves: every validation of run `<study>-<label>` (any status: a run still training shows its points
so far) from MLflow: `val/tau_native`, `val/tau` (with the run's selector) and `val/repair_gain` (the
selector's τ over the native path's, with its paired interval), `val/tau_oracle`, `val/coverage_first_error`,
`val/one_edit_gain` against `train/budget_minutes` (the run's own clock, CPU minutes in the budget
study). They are also written to `docs/data/<study>.csv`, which the repository keeps: a fresh machine
redraws the report from it (`--from-csv`) without the MLflow store the runs wrote, and a run continued on
a fresh machine from its carried snapshot keeps its earlier points (merged by run and step).

Fit (`--metric`): the teacher-forced τ = 1 + `val/tf_accept` by default (fixed held-out blocks, so
close checkpoints differ only by their weights; replay τ's interval on 32 conversations is wider
than what 45 CPU-minutes move), or replay τ `val/tau_native` (`val/tau` with the run's selector); τ(h) = a + b·ln h over the points at h ≥ `--fit-from` hours (held-out τ rises about linearly in
log-time over this range; with three or more points the residual is printed). Projection: τ(H) at
`--hours` H. Runs that continue a trained drafter count its training too: with `--start-hours H0`
(the hours the init checkpoint already trained, in this machine's hours) every point sits at
H0 + h, the step-0 point (H0) joins the fit, and the projection is τ(H0 + H): more of the same curve,
not a fresh one. Speedup under fixed-length verification, with the round costs measured here on the real
target (`--measure-costs`: AR ms per token, verify ms per 16-token block, draft ms per block for each
drafter depth in the study, at batch 1):

    S(H) = τ(H) · t_AR / (t_draft(depth) + t_verify16)

A deeper drafter must raise τ by its extra draft cost to pay. Without `--measure-costs` the speedup
column is left out.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

METRICS = (
    "val/tau_native",
    "val/tau",
    "val/tau_oracle",
    "val/coverage_first_error",
    "val/one_edit_gain",
    "val/tf_accept",
    "val/tf_loss",
    "val/repair_gain",
    "val/repair_gain_ci_low",
    "val/repair_gain_ci_high",
)
CLOCK = "train/budget_minutes"
COLUMNS = ("run", "step", "hours", *METRICS)


@dataclass(frozen=True)
class Point:
    run: str
    step: int
    hours: float
    values: dict[str, float]

    def __post_init__(self) -> None:  # the teacher-forced τ of a round anchored at a held-out position
        if "val/tf_accept" in self.values and TAU_TF not in self.values:
            self.values[TAU_TF] = 1.0 + self.values["val/tf_accept"]


TAU_TF = "val/tau_tf"  # derived: 1 + val/tf_accept (not stored)
FIT_METRICS = (TAU_TF, "val/tau_native", "val/tau")


def load_curves(client, experiment: str, study: str, labels: list[str]) -> list[Point]:
    """Every validation point of the study's runs. A run stopped and resumed is one MLflow run per
    attempt under the same name (an interrupted attempt is marked FAILED): their points are merged
    by step, a later attempt's point replacing an earlier one's at the same step."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    points = []
    for label in labels:
        found = client.search_runs([exp.experiment_id], f"tags.mlflow.runName = '{study}-{label}'",
                                   order_by=["attributes.start_time ASC"], max_results=1000)  # fmt: skip
        merged: dict[int, Point] = {}
        for run in found:
            run_id = run.info.run_id
            clock = {h.step: h.value for h in client.get_metric_history(run_id, CLOCK)}
            series = {m: {h.step: h.value for h in client.get_metric_history(run_id, m)} for m in METRICS}
            for step in sorted(series["val/tau_native"]):
                if step in clock:
                    merged[step] = Point(label, step, clock[step] / 60.0, {m: s[step] for m, s in series.items() if step in s})
        points += [merged[step] for step in sorted(merged)]
    return points


def merge_kept(points: list[Point], kept: list[Point], *, order: list[str]) -> list[Point]:
    """The store's points with the kept file's that the store no longer has (a fresh machine, or a run
    continued there from its carried snapshot), by run and step, the store's winning; runs in `order`."""
    fresh = {(p.run, p.step) for p in points}
    merged = [q for q in kept if (q.run, q.step) not in fresh] + points
    return sorted(merged, key=lambda q: (order.index(q.run) if q.run in order else len(order), q.step))


def write_csv(points: list[Point], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for p in points:
            w.writerow([p.run, p.step, f"{p.hours:.4f}", *(f"{p.values[m]:.4f}" if m in p.values else "" for m in METRICS)])
    tmp.replace(path)


def read_csv(path: Path) -> list[Point]:
    with path.open() as f:
        rows = list(csv.DictReader(f))
    return [Point(r["run"], int(r["step"]), float(r["hours"]), {m: float(r[m]) for m in METRICS if r.get(m)}) for r in rows]


# Student's t, 97.5% quantiles for 1..10 degrees of freedom (then the normal's 1.96 is within 0.2).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


@dataclass(frozen=True)
class Fit:
    """τ = a + b·ln h by least squares over n points (x = ln h, mean mx, Σ(x − mx)² = sxx), with the
    residual standard error s = sqrt(SSR / (n − 2)) (NaN with two points: no interval)."""

    a: float
    b: float
    rmse: float
    n: int
    mx: float = 0.0
    sxx: float = 0.0
    s: float = math.nan

    def at(self, hours: float) -> float:
        return self.a + self.b * math.log(hours)

    def interval_at(self, hours: float) -> tuple[float, float]:
        """95% interval of the fitted mean τ at `hours`: ± t·s·sqrt(1/n + (ln h − mx)²/sxx)."""
        if self.n < 3 or self.sxx <= 0:
            return math.nan, math.nan
        t = _T975[self.n - 3] if self.n - 2 <= len(_T975) else 1.96
        half = t * self.s * math.sqrt(1 / self.n + (math.log(hours) - self.mx) ** 2 / self.sxx)
        return self.at(hours) - half, self.at(hours) + half


def fit_log(points: list[Point], metric: str = "val/tau_native", *, fit_from: float = 0.1) -> Fit | None:
    """Least squares τ = a + b·ln h over the points at h ≥ fit_from (None with fewer than two)."""
    xy = [(math.log(p.hours), p.values[metric]) for p in points if p.hours >= fit_from and metric in p.values]
    if len(xy) < 2:
        return None
    n = len(xy)
    mx, my = sum(x for x, _ in xy) / n, sum(y for _, y in xy) / n
    sxx = sum((x - mx) ** 2 for x, _ in xy)
    b = sum((x - mx) * (y - my) for x, y in xy) / sxx if sxx > 0 else 0.0
    a = my - b * mx
    ssr = sum((a + b * x - y) ** 2 for x, y in xy)
    return Fit(a, b, math.sqrt(ssr / n), n, mx, sxx, math.sqrt(ssr / (n - 2)) if n > 2 else math.nan)


def measure_costs(depths: list[int], *, repeats: int = 3, tokens: int = 48) -> dict[str, float]:
    """Milliseconds at batch 1 on the real target: `ar` per token, `verify16` per round and
    `draft<d>` per round for each depth d (drafters built like the bundled one, with its draft
    vocabulary; untrained weights cost the same as trained ones). Medians over `repeats`."""
    import statistics

    import torch

    from drelay_model.decoding import GenerationConfig, SpeculativeEngine
    from drelay_model.drafter import BlockDrafter
    from drelay_model.drafter.checkpoint import load_drafter
    from drelay_model.target import load_target

    target = load_target("smollm2-135m")
    bundled, _, _ = load_drafter(str(ROOT / "checkpoints/smollm2-135m"), target)
    prompt = target.tokenizer("Explain how a rainbow forms, step by step.")["input_ids"]
    cfg = GenerationConfig(max_new_tokens=tokens, stop_on_eos=False)
    out: dict[str, list[float]] = {}
    engines = {"ar": SpeculativeEngine(target)}
    for d in depths:
        torch.manual_seed(0)
        config = type(bundled.config)(**{**bundled.config.__dict__, "num_layers": d})
        engines[f"draft{d}"] = SpeculativeEngine(target, BlockDrafter(config, target, bundled.draft_to_target).eval())
    for _ in range(repeats):  # interleaved, so drift moves every term alike
        for name, engine in engines.items():
            stats = engine.generate([prompt], cfg).stats  # batch 1: a step is a round
            if name == "ar":  # decode ms per token, prefill left out
                out.setdefault("ar", []).append(1e3 * (stats.time_total - stats.time_prefill) / max(stats.generated, 1))
                continue
            rounds = max(stats.drafted_steps, 1)  # every round verifies the whole block (no measured costs)
            out.setdefault(name, []).append(1e3 * stats.time_draft / rounds)
            out.setdefault("verify16", []).append(1e3 * stats.time_verify / rounds)
    return {k: statistics.median(v) for k, v in out.items()}


def plot(
    points: list[Point],
    fits: dict[str, Fit],
    path: Path,
    *,
    hours: float,
    metric: str = "val/tau_native",
    study: str = "budget study",
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for i, label in enumerate(dict.fromkeys(p.run for p in points)):
        color = f"C{i}"
        xy = [(p.hours, p.values[metric]) for p in points if p.run == label and metric in p.values]
        xy = [(x, y) for x, y in xy if x > 0]  # a log axis: a step-0 point shows only on the whole run's clock
        if not xy:
            continue
        ax.plot(*zip(*xy), marker="o", color=color, label=label)
        if label in fits:
            xs = [xy[0][0] * (hours / xy[0][0]) ** (k / 40) for k in range(41)]
            ax.plot(xs, [fits[label].at(x) for x in xs], linestyle="--", linewidth=1, color=color)
    ax.set_xscale("log")
    ax.set_xlabel("training CPU hours (one core; log scale)")
    ax.set_ylabel(
        {TAU_TF: "held-out teacher-forced τ (tokens / round)", "val/tau": "held-out replay τ, the run's selector"}.get(
            metric, "held-out replay τ, native (tokens / round)"
        )
    )
    ax.set_title(f"{study}: τ against CPU time, fitted a + b·ln h (dashed)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def drafter_depth(cfg, repo_path, pending: frozenset = frozenset()) -> int | None:
    """The layers a run trains: its init checkpoint's plus `drafter.grow_layers`, or `num_layers`;
    None when it starts from an earlier run of the study (in `pending`) that has not exported yet."""
    from drelay_model.drafter.checkpoint import read_checkpoint

    d = cfg.drafter
    if not d.init_checkpoint:
        return d.num_layers
    path = Path(repo_path(d.init_checkpoint))
    if path in pending and not path.exists():
        return None
    return read_checkpoint(path)[0].num_layers + d.grow_layers


def projected(fit: Fit, hours: float) -> str:
    """τ at `hours` with its 95% interval ("[–]" with two points: no interval)."""
    lo, hi = fit.interval_at(hours)
    return f"{fit.at(hours):.3f} " + (f"[{lo:.3f}, {hi:.3f}]" if not math.isnan(lo) else "[–]")


def repair_gain(values: dict[str, float]) -> str:
    """τ(selector) ÷ τ(native) with its paired interval, or "—" where the run has no selector."""
    if "val/repair_gain" not in values:
        return "—"
    from pipelines.common.intervals import Interval

    low, high = values.get("val/repair_gain_ci_low", math.nan), values.get("val/repair_gain_ci_high", math.nan)
    return Interval(values["val/repair_gain"], low, high).format()


def report(
    points: list[Point],
    depth: dict[str, int],
    costs: dict[str, float] | None,
    *,
    hours: float,
    fit_from: float,
    metric: str = "val/tau_native",
) -> dict[str, Fit]:
    """Print the table (markdown) and return the fits of `metric` (a τ)."""
    fits = {label: f for label in depth if (f := fit_log([p for p in points if p.run == label], metric, fit_from=fit_from))}
    head = "| run | depth | CPU h | τ native | τ selector | selector ÷ native [95%] | τ teacher-forced | oracle τ | coverage | one-edit gain | fit a + b·ln h (rmse, n) | τ at {h:g} h |"
    print(f"fitted: {metric}")
    print(head.format(h=hours) + (" S at {h:g} h |".format(h=hours) if costs else ""))
    print("|---" * (12 + bool(costs)) + "|")
    for label, d in depth.items():
        mine = [p for p in points if p.run == label]
        if not mine:
            print("| " + " | ".join([label, str(d or "—"), "—", "not trained yet", *[""] * (8 + bool(costs))]) + " |")
            continue
        last, fit = mine[-1], fits.get(label)
        v = last.values
        cells = [label, str(d), f"{last.hours:.2f}", f"{v.get('val/tau_native', math.nan):.3f}",
                 f"{v.get('val/tau', math.nan):.3f}", repair_gain(v), f"{v.get(TAU_TF, math.nan):.3f}",
                 f"{v.get('val/tau_oracle', math.nan):.3f}",
                 f"{v.get('val/coverage_first_error', math.nan):.3f}", f"{v.get('val/one_edit_gain', math.nan):.3f}"]  # fmt: skip
        cells += [f"{fit.a:.3f} + {fit.b:.3f}·ln h ({fit.rmse:.3f}, {fit.n})", projected(fit, hours)] if fit else ["—", "—"]
        if costs:
            speed = fit.at(hours) * costs["ar"] / (costs[f"draft{d}"] + costs["verify16"]) if fit and d else math.nan
            cells.append(f"{speed:.2f}×")
        print("| " + " | ".join(cells) + " |")
    if costs:
        print("costs (ms, batch 1): " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(costs.items())))
    return fits


def log_to_study_run(client, experiment: str, study: str, files: list[Path]) -> str:
    """Attach the curves (PNG, CSV) to the study's MLflow parent run, under `curves/` → its run id."""
    from drelay_model.errors import DRelayError

    exp = client.get_experiment_by_name(experiment)
    found = client.search_runs([exp.experiment_id], f"tags.mlflow.runName = '{study}'", order_by=["attributes.start_time DESC"],
                               max_results=1) if exp else []  # fmt: skip
    if not found:
        raise DRelayError(f"--log-mlflow: no MLflow run named {study!r} in experiment {experiment!r}")
    run_id = found[0].info.run_id
    for f in files:
        client.log_artifact(run_id, str(f), artifact_path="curves")
    return run_id


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", default="platform/studies/smollm2-135m-budget.yaml")
    p.add_argument("--experiment", default=None, help="MLflow experiment (default: the runs' mlflow.experiment)")
    p.add_argument("--from-csv", action="store_true", help="read docs/data/<study>.csv instead of MLflow")
    p.add_argument("--hours", type=float, default=8.0, help="total budget to project to (CPU hours)")
    p.add_argument("--fit-from", type=float, default=0.1, help="fit only points at ≥ this many hours")
    p.add_argument("--start-hours", type=float, default=0.0, help="hours the runs' init checkpoint already trained")
    p.add_argument("--metric", choices=FIT_METRICS, default=TAU_TF, help="the τ to fit and project (default teacher-forced)")
    p.add_argument("--measure-costs", action="store_true", help="time AR, verify and each depth's draft here")
    p.add_argument("--out", default=str(ROOT / "docs/img/budget_study.png"))
    p.add_argument("--log-mlflow", action="store_true", help="attach the PNG and CSV to the study's MLflow parent run")
    args = p.parse_args()
    from drelay_model.errors import DRelayError
    from pipelines.common.paths import repo_path
    from pipelines.study.spec import load_study, run_configs

    if args.hours <= 0 or args.fit_from <= 0 or args.start_hours < 0:
        raise DRelayError("--hours and --fit-from must be > 0, --start-hours ≥ 0")
    if args.log_mlflow and args.from_csv:
        raise DRelayError("--log-mlflow reads the runs from MLflow: leave out --from-csv")
    spec = load_study(args.spec)
    configs = run_configs(spec, repo_path)
    exports = frozenset(Path(repo_path(c.output_dir)) / c.ray.run_name / "drafter" for c in configs.values())
    depth = {label: drafter_depth(cfg, repo_path, exports) for label, cfg in configs.items()}
    csv_path = ROOT / "docs/data" / f"{spec.name}.csv"
    first = next(iter(configs.values()))  # the study's MLflow store and experiment
    experiment = args.experiment or first.mlflow.experiment
    if args.from_csv:
        if not csv_path.is_file():
            raise DRelayError(f"--from-csv: {csv_path} does not exist")
        points = read_csv(csv_path)
    else:
        from pipelines.common.tracking import get_client

        client = get_client(first.mlflow.tracking_uri)
        points = load_curves(client, experiment, spec.name, list(depth))
        points = merge_kept(points, read_csv(csv_path) if csv_path.is_file() else [], order=list(depth))
        if points:
            write_csv(points, csv_path)
    started = time.perf_counter()
    costs = measure_costs(sorted({d for d in depth.values() if d is not None})) if args.measure_costs else None
    if costs:
        print(f"[budget] round costs measured in {time.perf_counter() - started:.0f} s")
    total = [replace(q, hours=q.hours + args.start_hours) for q in points]  # on the whole training's clock
    hours = args.start_hours + args.hours
    fits = report(total, depth, costs, hours=hours, fit_from=args.fit_from, metric=args.metric)
    if points:
        plot(total, fits, Path(args.out), hours=hours, metric=args.metric, study=spec.name)
        print(f"wrote {args.out} and {csv_path}")
        if args.log_mlflow:
            run_id = log_to_study_run(client, experiment, spec.name, [Path(args.out), csv_path])
            print(f"logged both to MLflow run {spec.name} ({run_id}) under curves/")


if __name__ == "__main__":
    from cli import guarded

    raise SystemExit(guarded(main, Path(__file__).name))
