"""Replay comparison of drafter checkpoints on the benchmarks: native vs DRelay, and ablations.

Only greedy replay τ matters for these tables, and replay is exact (it equals τ of real greedy
decoding round for round), so nothing is decoded speculatively here:

    per benchmark:  AR greedy continuations, decoded once (`drelay eval`'s AR cell, cached in <out>/cells)
    per variant:    replay(selector) → τ;  replay(pool oracle) → oracle τ;  pool diagnostics
                    cached in <out>/replay/<benchmark>__<label>.json, keyed by the checkpoint's files

A variant is a label, a checkpoint and the selector to run on its pool (by default the one the
checkpoint was trained with, else `native`). `LABEL=DIR:native` runs a DRelay-trained drafter with
native selection, which separates what the selector adds from what joint training did to the drafter.

Summary: τ per benchmark per variant, the mean over benchmarks, and each variant's ratio to the
baseline: mean τ(variant) / mean τ(baseline), and per benchmark τ(variant) / τ(baseline).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm.auto import tqdm

from drelay_model.drafter.checkpoint import read_checkpoint
from drelay_model.errors import DRelayError
from drelay_model.selectors import default_registry
from pipelines.benchmarks import BenchmarkPrompt
from pipelines.config import NAME_PATTERN
from pipelines.eval_prompts import PromptEncoder
from pipelines.eval_results import CellResult, ReplayResult, fingerprint
from pipelines.evaluate import MethodUnderTest, checkpoint_identity, replay_cell
from pipelines.resolve import AR, load_method

_LABEL = re.compile(NAME_PATTERN)


@dataclass(frozen=True)
class Variant:
    """label: a column of the table; checkpoint: a drafter directory; selector: a registry name."""

    label: str
    checkpoint: str
    selector: str


def saved_selector(checkpoint: str) -> str:
    """The selector a checkpoint was trained with (meta["selector"]["name"]), else `native`."""
    _, _, meta = read_checkpoint(checkpoint)  # a missing or corrupt checkpoint is a DRelayError
    return (meta.get("selector") or {}).get("name") or "native"


def parse_variant(text: str) -> Variant:
    """`LABEL=DIR` or `LABEL=DIR:SELECTOR` → Variant (DIR must be a checkpoint directory)."""
    label, eq, rest = text.partition("=")
    if not eq or not rest:
        raise DRelayError(f"--variant {text!r}: expected LABEL=DIR or LABEL=DIR:SELECTOR")
    if not _LABEL.match(label):
        raise DRelayError(f"--variant {text!r}: label must be 1–64 of [A-Za-z0-9._+-], starting with a letter or digit")
    path, selector = rest, None
    if not Path(rest).is_dir() and ":" in rest:
        path, _, selector = rest.rpartition(":")
    if not Path(path).is_dir():
        raise DRelayError(f"--variant {label}: checkpoint directory '{path}' not found")
    names = list(default_registry().names())
    if selector is not None and selector not in names:
        raise DRelayError(f"--variant {label}: unknown selector '{selector}' (choose from: {', '.join(names)})")
    saved = saved_selector(path)
    if selector is not None and selector != saved and default_registry().factory(selector).capabilities.trainable:
        raise DRelayError(f"--variant {label}: checkpoint '{path}' holds no trained '{selector}' selector (it has: {saved})")
    return Variant(label, path, selector or saved)


def parse_variants(texts: Sequence[str], baseline: str | None) -> tuple[list[Variant], str]:
    """Variants in the given order, and the baseline label (default: the first variant)."""
    if not texts:
        raise DRelayError("give at least one --variant LABEL=DIR[:SELECTOR]")
    variants = [parse_variant(t) for t in texts]
    labels = [v.label for v in variants]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise DRelayError(f"--variant labels must be unique; repeated: {', '.join(dup)}")
    base = baseline or labels[0]
    if base not in labels:
        raise DRelayError(f"--baseline '{base}' is not a variant label (have: {', '.join(labels)})")
    return variants, base


@dataclass
class VariantCell:
    """Replay of one variant on one benchmark: the counts (they merge exactly across prompts) and
    pool diagnostics of `replay_cell`, and τ / oracle τ per prompt turn."""

    benchmark: str
    label: str
    fingerprint: str
    replay: ReplayResult
    per_prompt: dict[str, list[float]]  # "prompt_id#turn" → [τ, oracle τ]
    elapsed_s: float

    @classmethod
    def from_dict(cls, d: dict) -> "VariantCell":
        return cls(**{**d, "replay": ReplayResult.from_dict(d["replay"])})


class ReplayStore:
    """<out>/replay/<benchmark>__<label>.json, written atomically; a stale or torn file is redone."""

    def __init__(self, out_dir: Path) -> None:
        self.root = Path(out_dir) / "replay"

    def path(self, benchmark: str, label: str) -> Path:
        return self.root / f"{benchmark}__{label}.json"

    def load(self, benchmark: str, label: str, fp: str) -> VariantCell | None:
        path = self.path(benchmark, label)
        try:
            cell = VariantCell.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError, KeyError):
            return None
        return cell if cell.fingerprint == fp else None

    def save(self, cell: VariantCell) -> None:
        path = self.path(cell.benchmark, cell.label)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(asdict(cell)))
        os.replace(tmp, path)


def replay_variants(
    target,
    target_spec: str,
    variants: Sequence[Variant],
    prompts: Mapping[str, Sequence[BenchmarkPrompt]],
    ar_cells: Mapping[str, CellResult],
    encoder: PromptEncoder,
    store: ReplayStore,
    *,
    progress: bool = True,
) -> dict[tuple[str, str], VariantCell]:
    """Every (benchmark, variant) cell, variant-major (one checkpoint in memory at a time)."""
    cells: dict[tuple[str, str], VariantCell] = {}
    total = len(variants) * len(prompts)
    with tqdm(total=total, desc="replay", unit="cell", disable=not progress, file=sys.stderr) as bar:
        for v in variants:
            method = None
            for bench, bench_prompts in prompts.items():
                bar.set_postfix_str(f"{v.label}/{bench}")
                fp = fingerprint({
                    "checkpoint": checkpoint_identity(v.checkpoint), "selector": v.selector,
                    "reference": ar_cells[bench].fingerprint, "prompts": [p.prompt_id for p in bench_prompts],
                })  # fmt: skip
                cell = store.load(bench, v.label, fp)
                if cell is None:
                    if method is None:
                        drafter, selector = load_method(v.selector, target, target_spec=target_spec, checkpoint=v.checkpoint)
                        method = MethodUnderTest(v.label, drafter, selector)
                    cell = _replay_one(target, method, bench, bench_prompts, ar_cells[bench], encoder, fp, progress)
                    store.save(cell)
                cells[(bench, v.label)] = cell
                bar.update(1)
    return cells


def _replay_one(target, method, bench, prompts, ar_cell, encoder, fp, progress) -> VariantCell:
    t0 = time.perf_counter()
    with tqdm(total=len(prompts), desc=f"{bench}/{method.name}", unit="prompt", leave=False, disable=not progress, file=sys.stderr) as bar:
        res, per_prompt = replay_cell(target, method, prompts, encoder, ar_cell.outputs, bar=bar)
    return VariantCell(
        benchmark=bench, label=method.name, fingerprint=fp, replay=res,
        per_prompt={f"{pid}#{turn}": [t, o] for (pid, turn), (t, o) in per_prompt.items()},
        elapsed_s=time.perf_counter() - t0,
    )  # fmt: skip


@dataclass
class ComparisonSummary:
    """Flat metrics per variant (`<benchmark>/tau`, `<benchmark>/oracle_tau`, `mean_tau`,
    `mean_oracle_tau`, `ratio_vs_baseline`, `<benchmark>/ratio_vs_baseline`) and the tables."""

    baseline: str
    benchmarks: list[str]
    metrics: dict[str, dict[str, float]]

    def markdown(self) -> str:
        from pipelines.report import BENCHMARK_LABELS

        labels = list(self.metrics)
        head = ["benchmark", *[f"τ {v}" for v in labels], *[f"{v} ÷ {self.baseline}" for v in labels if v != self.baseline]]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for b in [*self.benchmarks, "mean"]:
            key = "mean_tau" if b == "mean" else f"{b}/tau"
            rkey = "ratio_vs_baseline" if b == "mean" else f"{b}/ratio_vs_baseline"
            name = "**mean**" if b == "mean" else BENCHMARK_LABELS.get(b, b)
            row = [name, *[f"{self.metrics[v][key]:.3f}" for v in labels]]
            row += [f"{self.metrics[v][rkey]:.3f}" for v in labels if v != self.baseline]
            lines.append("| " + " | ".join(row) + " |")
        lines += ["", "| variant | mean τ | mean oracle τ | τ ÷ oracle τ | coverage @ 1st error | one-edit gain |", "|---|---|---|---|---|---|"]
        for v in labels:
            m = self.metrics[v]
            eff = m["mean_tau"] / m["mean_oracle_tau"] if m["mean_oracle_tau"] else 0.0
            lines.append(f"| {v} | {m['mean_tau']:.3f} | {m['mean_oracle_tau']:.3f} | {eff:.3f} | "
                         f"{m['mean_coverage_first_error']:.3f} | {m['mean_one_edit_gain']:.3f} |")  # fmt: skip
        return "\n".join(lines) + "\n"


def summarize(cells: Mapping[tuple[str, str], VariantCell], variants: Sequence[Variant], benchmarks: Sequence[str], baseline: str) -> ComparisonSummary:
    """Means over benchmarks (each benchmark weighs the same, as in the paper's Avg. column)."""
    metrics: dict[str, dict[str, float]] = {}
    for v in variants:
        m: dict[str, float] = {}
        for b in benchmarks:
            r = cells[(b, v.label)].replay
            m.update({f"{b}/tau": r.tau, f"{b}/oracle_tau": r.oracle_tau, f"{b}/coverage_first_error": r.diagnostics.coverage_first_error,
                      f"{b}/one_edit_gain": r.diagnostics.one_edit_gain})  # fmt: skip
        for key in ("tau", "oracle_tau", "coverage_first_error", "one_edit_gain"):
            m[f"mean_{key}"] = sum(m[f"{b}/{key}"] for b in benchmarks) / len(benchmarks)
        metrics[v.label] = m
    base = metrics[baseline]
    for m in metrics.values():
        m["ratio_vs_baseline"] = m["mean_tau"] / base["mean_tau"] if base["mean_tau"] else 0.0
        for b in benchmarks:
            m[f"{b}/ratio_vs_baseline"] = m[f"{b}/tau"] / base[f"{b}/tau"] if base[f"{b}/tau"] else 0.0
    return ComparisonSummary(baseline, list(benchmarks), metrics)


def plot_comparison(summary: ComparisonSummary, path: Path, title: str) -> Path:
    """Grouped bars: τ per benchmark (and the mean) per variant, with each variant's oracle τ as a tick."""
    from pipelines.eval_plots import _pyplot, _save
    from pipelines.report import BENCHMARK_LABELS

    plt = _pyplot()
    labels = [BENCHMARK_LABELS.get(b, b) for b in summary.benchmarks] + ["Avg."]
    variants = list(summary.metrics)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.2 * len(labels) + 2), 4.2))
    width = 0.8 / max(len(variants), 1)
    for i, v in enumerate(variants):
        m = summary.metrics[v]
        taus = [m[f"{b}/tau"] for b in summary.benchmarks] + [m["mean_tau"]]
        oracle = [m[f"{b}/oracle_tau"] for b in summary.benchmarks] + [m["mean_oracle_tau"]]
        xs = [j + (i - (len(variants) - 1) / 2) * width for j in range(len(labels))]
        bars = ax.bar(xs, taus, width, label=v)
        ax.scatter(xs, oracle, marker="_", s=120, color=bars.patches[0].get_facecolor(), linewidths=2)
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks(range(len(labels)), labels, rotation=20)
    ax.set_ylabel("replay τ (bars) · oracle τ (ticks)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(ncols=min(len(variants), 4), fontsize=8, loc="upper left")
    ax.set_title(title, fontsize=10)
    return _save(fig, path)


__all__ = ["AR", "ComparisonSummary", "ReplayStore", "Variant", "VariantCell", "parse_variants", "plot_comparison", "replay_variants", "summarize"]
