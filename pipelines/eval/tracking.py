"""The MLflow layout of an evaluation — written by `drelay eval`, read back by `drelay report`.

    <run-name>                  parent (drelay.level=evaluation): tags target, methods, checkpoint,
    │                           hardware, git commit, temperature; params = the EvalConfig;
    │                           metrics `<method>/mean_tau`, `<method>/mean_speedup` (+ _ci_low,
    │                           _ci_high: their 95% intervals); artifacts:
    │                           report.md/csv, relative.csv, plots/*.png, config.json, summary.json
    └── <method>                one per method (drelay.level=method) = one Table-1 row:
        │                       `<benchmark>/tau`, `<benchmark>/speedup` (+ _std, _ci_low, _ci_high, tokens_per_s,
        │                       tau_replay, oracle_tau, efficiency, coverage…, one_edit_gain),
        │                       `mean_tau`, `mean_speedup` (headline copies: `tau`, `speedup`), `mean_…`, pooled slot_acceptance/NN,
        │                       ms_draft|select|verify|other, throughput/cN, speedup/cN
        └── <benchmark>/<method>   one per cell (drelay.level=cell): the unprefixed metrics,
                                series `slot_acceptance` (step = slot) and `throughput` (step =
                                concurrency), per-prompt table prompts.json + prompts.csv, cell JSON

Cells are logged as they finish; method and parent summaries at the end. Every run is opened by
`pipelines.common.tracking.tracked_run`, so an error or Ctrl-C leaves them FAILED, never RUNNING.
"""

from __future__ import annotations

import csv
import dataclasses
import json
from contextlib import ExitStack
from pathlib import Path

from drelay_model.errors import DRelayError
from pipelines.common.methods import AR
from pipelines.common.provenance import checkpoint_run_tag
from pipelines.common.tracking import PARENT_TAG, TrackedRun
from pipelines.eval.report import ComparisonTable, MethodRow, interval_note
from pipelines.eval.results import CellResult

LEVEL_TAG = "drelay.level"
HEADLINE = tuple(f"mean_{n}{suffix}" for n in ("tau", "speedup") for suffix in ("", "_ci_low", "_ci_high"))
KIND = ("drelay.kind", "eval")


class EvalTracker:
    """Writes the layout above under an open parent run; method runs live in `stack`."""

    def __init__(self, parent: TrackedRun, stack: ExitStack, checkpoints: dict[str, str | None]) -> None:
        self.parent, self.stack, self.checkpoints = parent, stack, checkpoints
        self._methods: dict[str, TrackedRun] = {}

    def method_run(self, method: str) -> TrackedRun:
        if method not in self._methods:
            tags = {LEVEL_TAG: "method", "drelay.method": method, "drelay.checkpoint": self.checkpoints.get(method) or "", KIND[0]: KIND[1],
                    **checkpoint_run_tag(self.checkpoints.get(method))}  # fmt: skip
            self._methods[method] = self.stack.enter_context(self.parent.child(method, tags=tags))
        return self._methods[method]

    def log_cell(self, cell: CellResult, metrics: dict[str, float], *, loaded: bool, cell_file: Path, work_dir: Path) -> None:
        """One nested cell run, and the cell's `<benchmark>/…` metrics on its method run."""
        tags = {
            LEVEL_TAG: "cell",
            "drelay.benchmark": cell.benchmark,
            "drelay.method": cell.method,
            "drelay.resumed": str(loaded).lower(),
        }
        with self.method_run(cell.method).child(f"{cell.benchmark}/{cell.method}", tags=tags) as run:
            run.log_params(
                {"benchmark": cell.benchmark, "method": cell.method, "prompts": len({p.prompt_id for p in cell.prompts})}
            )
            run.log_metrics(metrics)
            _log_series(run, "slot_acceptance", metrics, "slot_acceptance/")
            _log_series(run, "throughput", metrics, "throughput/c")
            rows = [dataclasses.asdict(p) for p in cell.prompts]
            run.log_table(rows, "prompts.json")
            run.log_artifact(_write_csv(rows, work_dir / "prompts" / f"{cell.benchmark}__{cell.method}.csv"), "prompts")
            run.log_artifact(cell_file, "cells")
        prefixed = {f"{cell.benchmark}/{k}": v for k, v in metrics.items() if "/" not in k}
        self.method_run(cell.method).log_metrics(prefixed)

    def log_summary(self, method_metrics: dict[str, dict[str, float]], files: list[Path], plots: list[Path]) -> None:
        for method, m in method_metrics.items():
            # headline copies: tau, speedup (and their _ci_low / _ci_high) = the means over benchmarks
            headline = {k[len("mean_") :]: m[k] for k in HEADLINE if k in m}
            self.method_run(method).log_metrics({**m, **headline})
            self.parent.log_metrics({f"{method}/mean_{k}": v for k, v in headline.items()})
        for f in files:
            self.parent.log_artifact(f)
        for p in plots:
            self.parent.log_artifact(p, "plots")


def _log_series(run: TrackedRun, key: str, metrics: dict[str, float], prefix: str) -> None:
    for name, value in metrics.items():
        if name.startswith(prefix) and name[len(prefix) :].isdigit():
            run.log_metrics({key: value}, step=int(name[len(prefix) :]))


def _write_csv(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]) if rows else ["prompt_id"])
        writer.writeheader()
        writer.writerows(rows)
    return path


# ---- reading it back -------------------------------------------------------------------------------


def find_evaluation(client, experiment: str, ref: str | None):
    """The parent run named or identified by `ref` (latest FINISHED of that name), or the latest
    FINISHED evaluation of the experiment when `ref` is None."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise DRelayError(f"no MLflow experiment '{experiment}' at {client.tracking_uri}")
    query = f"tags.`{LEVEL_TAG}` = 'evaluation' and attributes.status = 'FINISHED'"
    if ref and any(q in ref for q in "'\"`"):
        raise DRelayError(f"run name or id must not contain quotes, got {ref!r}")
    if ref:
        by_id = client.search_runs([exp.experiment_id], f"attributes.run_id = '{ref}'") if _looks_like_id(ref) else []
        if by_id:
            return by_id[0]
        query += f" and attributes.run_name = '{ref}'"
    runs = client.search_runs([exp.experiment_id], query, max_results=1, order_by=["attributes.start_time DESC"])
    if not runs:
        what = f"named or with id '{ref}'" if ref else "at all"
        raise DRelayError(f"no finished evaluation run {what} in experiment '{experiment}' ({client.tracking_uri})")
    return runs[0]


def _looks_like_id(ref: str) -> bool:
    return len(ref) == 32 and all(ch in "0123456789abcdef" for ch in ref)


def method_rows(client, parent) -> tuple[tuple[str, ...], list[MethodRow], dict[str, float]]:
    """(benchmarks, speculative method rows in evaluation order, AR's metrics) of a parent run."""
    tags = parent.data.tags
    query = f"tags.`{PARENT_TAG}` = '{parent.info.run_id}' and tags.`{LEVEL_TAG}` = 'method'"
    children = {r.data.tags.get("drelay.method"): r for r in client.search_runs([parent.info.experiment_id], query)}
    order = [m for m in tags.get("drelay.methods", "").split(",") if m in children]
    rows = [MethodRow(m, dict(children[m].data.metrics)) for m in order if m != AR]
    ar = dict(children[AR].data.metrics) if AR in children else {}
    benchmarks = tuple(b for b in tags.get("drelay.benchmarks", "").split(",") if b)
    return benchmarks, rows, ar


def write_json(path: Path, data: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=str))
    return path


def build_table(client, experiment: str, refs: list[str]) -> tuple[ComparisonTable, str, dict[str, dict[str, float]]]:
    """Rows of every requested evaluation; returns (table, title, all method metrics incl. AR)."""
    parents = [find_evaluation(client, experiment, ref) for ref in (refs or [None])]
    benchmarks: tuple[str, ...] = ()
    rows, everything, titles = [], {}, []
    for parent in parents:
        benches, method_list, ar = method_rows(client, parent)
        benchmarks = benchmarks or benches
        name = parent.info.run_name
        prefix = f"{name}:" if len(parents) > 1 else ""
        rows += [MethodRow(prefix + r.label, r.metrics) for r in method_list]
        everything.update({prefix + r.label: r.metrics for r in method_list})
        if ar:
            everything[prefix + AR] = ar
        tags = parent.data.tags
        titles.append(f"{name} ({tags.get('drelay.target', '?')}, T={tags.get('drelay.temperature', '?')}, "
                      f"checkpoint {tags.get('drelay.checkpoint', '?')}, {tags.get('drelay.hardware', '?')})")  # fmt: skip
    notes = ["S = tokens/s ÷ AR tokens/s (same engine and hardware, prefill included); τ = tokens committed per round."]
    if any(k.endswith("_ci_low") for r in rows for k in r.metrics):
        params = parents[0].data.params
        notes.append(
            interval_note({"resamples": params.get("bootstrap_resamples", "?"), "seed": params.get("bootstrap_seed", "?")})
        )
    return ComparisonTable(benchmarks, rows, notes), "; ".join(titles), everything
