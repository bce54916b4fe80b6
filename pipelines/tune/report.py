"""A finished sweep's summary: the trial table, the plots, the best trial and its ready-to-train config,
written next to the results and logged on the MLflow parent run.

When the base config continues a checkpoint (`drafter.init_checkpoint`), the table also holds a
`start` row: that checkpoint's own held-out metrics, measured once with the trials' validation set
and function (cached in `start.json`), so a reader sees whether any trial beats what it started from.

Each trial's metric carries its 95% interval over the validation prompts where the trial logged one
(`<metric>_ci_low` / `_ci_high`: `val/tau`'s, pipelines/train/worker.py). Trials train different
drafters, so no paired comparison between them is possible here; the summary says whether the best
trial's interval and the runner-up's are apart (resolved) or overlap (not resolved: a conservative
test — a paired `drelay compare` of the two checkpoints over the same prompts resolves smaller gaps).
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from pipelines.common.tracking import PARENT_TAG, TrackedRun
from pipelines.tune.config import SweepConfig
from pipelines.tune.trial import TrialContext, best_config_doc, trial_run_name

COMPLETED, STOPPED, ERROR = "completed", "stopped early", "error"


@dataclass(frozen=True)
class SweepResult:
    """A finished sweep. `best_value` / `start_value`: the metric of the best trial and of the start
    checkpoint (None when there is no completed trial / no init checkpoint to start from)."""

    sweep_dir: Path
    parent_run_id: str
    best_trial_id: str | None
    best_config: Path | None
    rows: list[dict]
    metric: str = "val/tau"
    mode: str = "max"
    best_value: float | None = None
    start_value: float | None = None
    start_ci: tuple[float, float] | None = None  # the start checkpoint's interval, when it logged one

    def _interval(self, row: dict | None) -> tuple[float, float] | None:
        low, high = (row or {}).get(f"{self.metric}_ci_low"), (row or {}).get(f"{self.metric}_ci_high")
        return (low, high) if low is not None and high is not None else None

    def _best(self) -> dict | None:
        return next((r for r in self.rows if r.get("trial_id") == self.best_trial_id), None)

    def best_against_start(self) -> str:
        """One line: the best trial's metric beside the start checkpoint's, and whether it beats it."""
        best = "none" if self.best_value is None else f"{self.best_trial_id} {self.metric} {self.best_value:.4f}"
        best += _bracket(self._interval(self._best())) if self.best_value is not None else ""
        if self.start_value is None:
            return f"best trial: {best}; start: no init checkpoint"
        line = f"best trial: {best}; start (init checkpoint): {self.metric} {self.start_value:.4f}{_bracket(self.start_ci)}"
        if self.best_value is None:
            return line
        beats = self.best_value > self.start_value if self.mode == "max" else self.best_value < self.start_value
        line = f"{line}; the best trial {'beats' if beats else 'does not beat'} its start"
        return line + _overlap_note(self._interval(self._best()), self.start_ci)

    def best_against_runner_up(self) -> str:
        """One line: the runner-up's metric and interval, and whether the best trial is resolved from it."""
        order = ranked(self.rows, self.metric, self.mode)
        if len(order) < 2 or order[0].get("trial_id") != self.best_trial_id:
            return "runner-up: none"
        second = order[1]
        line = f"runner-up: {second['trial_id']} {self.metric} {second[self.metric]:.4f}{_bracket(self._interval(second))}"
        return line + _overlap_note(self._interval(order[0]), self._interval(second), against="the runner-up")


def _bracket(ci: tuple[float, float] | None) -> str:
    return f" [{ci[0]:.4f}, {ci[1]:.4f}]" if ci is not None else ""


def _overlap_note(best: tuple[float, float] | None, other: tuple[float, float] | None, against: str = "its start") -> str:
    """Whether two 95% intervals are apart (resolved) or overlap; empty without both."""
    if best is None or other is None:
        return ""
    if best[0] > other[1] or best[1] < other[0]:
        return f" (95% intervals apart: resolved from {against})"
    return f" (95% intervals overlap: not resolved from {against})"


def trial_runs(client, parent: TrackedRun) -> dict[str, list]:
    """The parent's nested MLflow runs by run name (a restarted trial may have several)."""
    runs = client.search_runs([parent.experiment_id], f"tags.`{PARENT_TAG}` = '{parent.run_id}'", max_results=5000)
    out: dict[str, list] = {}
    for run in sorted(runs, key=lambda r: r.info.start_time):
        out.setdefault(run.info.run_name, []).append(run)
    return out


def write_best(ctx: TrialContext, params: dict, folder: Path, header: str) -> Path:
    path = folder / "best.yaml"
    doc = best_config_doc(ctx, params)
    path.write_text(f"# {header}\n# train it: drelay train --config {path}\n" + yaml.safe_dump(doc, sort_keys=False))
    return path


def trial_rows(sweep: SweepConfig, ctx: TrialContext, grid) -> list[dict]:
    """One row per trial: id, run name, status, steps trained, sampled values, final metric."""
    rows = []
    for result in grid:
        trial_id = result.metrics.get("trial_id") or Path(result.path).name
        steps = int(result.metrics.get("step") or 0)
        status = ERROR if result.error else COMPLETED if steps >= ctx.max_steps else STOPPED
        value = result.metrics.get(sweep.metric)
        row = {"trial_id": trial_id, "run_name": trial_run_name(ctx, trial_id), "status": status, "steps": steps}
        row.update({path: result.config["params"].get(path) for path in sweep.space})
        row[sweep.metric] = float(value) if value is not None else None
        for side in ("ci_low", "ci_high"):  # its 95% interval over the validation prompts, when logged
            bound = result.metrics.get(f"{sweep.metric}_{side}")
            row[f"{sweep.metric}_{side}"] = float(bound) if bound is not None else None
        rows.append(row)
    return sorted(rows, key=lambda r: r["trial_id"])


def ranked(rows: list[dict], metric: str, mode: str) -> list[dict]:
    """The trials that trained their whole budget (else all that reported), best first."""
    scored = [r for r in rows if r.get(metric) is not None and math.isfinite(r[metric])]
    pool = [r for r in scored if r["status"] == COMPLETED] or scored
    return sorted(pool, key=lambda r: r[metric], reverse=mode == "max")


def best_row(rows: list[dict], metric: str, mode: str) -> dict | None:
    """The best trial that trained its whole budget (else the best of all that reported)."""
    order = ranked(rows, metric, mode)
    return order[0] if order else None


def checkpoint_of(folder: Path, row: dict) -> Path | None:
    """A completed trial's exported drafter, else its latest Ray Train checkpoint."""
    exported = folder / "trials" / row["run_name"] / "drafter"
    if exported.is_dir():
        return exported
    ckpts = sorted(
        (p for p in (folder / "train" / row["run_name"]).glob("checkpoint_*") if p.is_dir()), key=lambda p: p.stat().st_mtime
    )
    return ckpts[-1] if ckpts else None


def link_trial_runs(rows: list[dict], parent: TrackedRun, client, folder: Path) -> None:
    """Tag each trial's nested run (id, status, checkpoint); a run whose trial ASHA stopped — its
    process was ended mid-run — is closed as KILLED."""
    runs = trial_runs(client, parent)
    for row in rows:
        attempts = runs.get(row["run_name"], [])
        row["mlflow_run_id"] = attempts[-1].info.run_id if attempts else None
        ckpt = checkpoint_of(folder, row)
        row["checkpoint"] = str(ckpt) if ckpt else None
        if not attempts:
            continue
        run = attempts[-1]
        client.set_tag(run.info.run_id, "drelay.trial_id", row["trial_id"])
        client.set_tag(run.info.run_id, "drelay.trial_status", row["status"])
        if ckpt:
            client.set_tag(run.info.run_id, "drelay.checkpoint", ckpt.as_uri())
        # A stopped trial's run ends RUNNING (process killed) or FAILED (interrupted in time to
        # unwind): either way it was stopped, not broken.
        if row["status"] == STOPPED and run.info.status != "FINISHED":
            client.set_terminated(run.info.run_id, "KILLED")
        elif run.info.status == "RUNNING":
            client.set_terminated(run.info.run_id, "FAILED")


def write_table(rows: list[dict], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def plot_parallel(rows: list[dict], params: list[str], metric: str, path: Path) -> None:
    """Parallel coordinates: one axis per swept value (scaled to its sampled range) and the metric;
    one line per trial, coloured by the metric."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes = [*params, metric]
    scored = [r for r in rows if r[metric] is not None]
    fig, ax = plt.subplots(figsize=(2.2 * len(axes) + 1, 4))
    lo = {a: min(_num(r[a]) for r in scored) for a in axes} if scored else {}
    hi = {a: max(_num(r[a]) for r in scored) for a in axes} if scored else {}
    values = [r[metric] for r in scored]
    cmap = plt.get_cmap("viridis")
    for r in scored:
        ys = [(_num(r[a]) - lo[a]) / ((hi[a] - lo[a]) or 1.0) for a in axes]
        shade = (r[metric] - min(values)) / ((max(values) - min(values)) or 1.0)
        ax.plot(range(len(axes)), ys, color=cmap(shade), alpha=0.85, linestyle="-" if r["status"] == COMPLETED else ":")
    ax.set_xticks(range(len(axes)), [f"{a}\n[{lo.get(a, 0):.3g}, {hi.get(a, 0):.3g}]" for a in axes], fontsize=7)
    ax.set_yticks([])
    ax.set_title(f"{len(scored)} trials (dotted: stopped early); colour = {metric}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_metric_vs_params(rows: list[dict], params: list[str], metric: str, path: Path, reference: float | None = None) -> None:
    """The metric against each swept value, one panel per value (`reference`: the init checkpoint's
    own value, a dashed line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axs = plt.subplots(1, len(params), figsize=(3.6 * len(params), 3.2), squeeze=False)
    for ax, param in zip(axs[0], params):
        for status, marker in ((COMPLETED, "o"), (STOPPED, "x")):
            pts = [(_num(r[param]), r[metric]) for r in rows if r["status"] == status and r[metric] is not None]
            if pts:
                ax.scatter(*zip(*pts), marker=marker, label=status)
        if reference is not None:
            ax.axhline(reference, color="grey", ls="--", lw=1, label="init checkpoint")
        xs = [_num(r[param]) for r in rows]
        if min(xs) > 0 and max(xs) / min(xs) >= 100:  # a log-range value (e.g. the learning rate)
            ax.set_xscale("log")
        ax.set_xlabel(param, fontsize=8)
        ax.set_ylabel(metric)
    axs[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _num(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return float(hash(str(value)) % 1000)  # a categorical value: any stable position


START = "start"  # the trial id of the reference row


def start_reference(base, folder: Path) -> dict | None:
    """`val/*` of the base config's init checkpoint on the trials' validation prompts (cached), or
    None when the sweep does not continue a checkpoint. `base` is the validated training config."""
    if not base.drafter.init_checkpoint:
        return None
    cache = folder / "start.json"
    if cache.is_file():
        return json.loads(cache.read_text())
    from drelay_model.target import load_target
    from pipelines.common.checkpoint_refs import rooted_local
    from pipelines.train.model_io import build_module
    import torch

    from pipelines.train.worker import feature_source, held_out_set, load_data, training_precision, validate, validation_set

    # the init checkpoint and the data, wherever this runs from
    cfg = training_precision(rooted_local(base), torch.device("cpu"))
    target = load_target(cfg.target.spec, dtype=cfg.target.dtype)
    _, val_seqs = load_data(cfg, target)
    module = build_module(cfg, target, [])
    held = held_out_set(cfg, val_seqs, feature_source(cfg, target, module))  # the trials' teacher-forced metrics too
    metrics = validate(target, module, *validation_set(cfg, target, val_seqs), held)
    cache.write_text(json.dumps(metrics, indent=2))
    return metrics


def summarize(
    sweep: SweepConfig, ctx: TrialContext, grid, parent: TrackedRun, client, folder: Path, start: dict | None = None
) -> SweepResult:
    rows = trial_rows(sweep, ctx, grid)
    link_trial_runs(rows, parent, client, folder)
    table, reference = rows, None
    if start is not None and start.get(sweep.metric) is not None:
        reference = float(start[sweep.metric])
        bounds = {f"{sweep.metric}_{side}": start.get(f"{sweep.metric}_{side}") for side in ("ci_low", "ci_high")}
        table = rows + [{"trial_id": START, "run_name": "init_checkpoint", "status": "reference", "steps": 0,
                         **{p: None for p in sweep.space}, sweep.metric: reference, **bounds, "mlflow_run_id": None,
                         "checkpoint": None}]  # fmt: skip
        parent.log_metrics({f"start/{k}": v for k, v in start.items()})
    params = list(sweep.space)
    write_table(table, folder / "trials.csv")
    plot_parallel(rows, params, sweep.metric, folder / "parallel_coordinates.png")
    plot_metric_vs_params(rows, params, sweep.metric, folder / "metric_vs_params.png", reference=reference)
    parent.log_table(table, "trials.json")
    for name in ("trials.csv", "parallel_coordinates.png", "metric_vs_params.png"):
        parent.log_artifact(folder / name)
    best = best_row(rows, sweep.metric, sweep.mode)
    best_path = None
    if best is not None:
        header = f"best trial {best['trial_id']} of sweep {sweep.name}: {sweep.metric} {best[sweep.metric]:.4f} after {best['steps']} steps"
        best_path = write_best(ctx, {p: best[p] for p in params}, folder, header)
        parent.log_artifact(best_path)
        parent.set_tags({"best_trial_id": best["trial_id"], "best_run_id": best["mlflow_run_id"] or ""})
        parent.log_metrics(
            {f"best/{sweep.metric}{suffix}": best.get(f"{sweep.metric}{suffix}") for suffix in ("", "_ci_low", "_ci_high")}
        )
    counts = {s: sum(r["status"] == s for r in rows) for s in (COMPLETED, STOPPED, ERROR)}
    parent.log_metrics({f"trials/{s.replace(' ', '_')}": n for s, n in counts.items()})
    return SweepResult(
        folder,
        parent.run_id,
        best["trial_id"] if best else None,
        best_path,
        rows,
        metric=sweep.metric,
        mode=sweep.mode,
        best_value=float(best[sweep.metric]) if best else None,
        start_value=reference,
        start_ci=_start_interval(start, sweep.metric),
    )


def _start_interval(start: dict | None, metric: str) -> tuple[float, float] | None:
    """The start checkpoint's 95% interval of `metric`, when its validation logged one."""
    if start is None or start.get(f"{metric}_ci_low") is None or start.get(f"{metric}_ci_high") is None:
        return None
    return float(start[f"{metric}_ci_low"]), float(start[f"{metric}_ci_high"])
