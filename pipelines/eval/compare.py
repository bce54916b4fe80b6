"""Replay comparison of drafter checkpoints on the benchmarks: native vs DRelay, and ablations.

Only greedy replay τ matters for these tables, and replay is exact (it equals τ of real greedy
decoding round for round), so nothing is decoded speculatively here:

    per benchmark:  AR greedy continuations, decoded once (`drelay eval`'s AR cell, cached in <out>/cells)
    per variant:    replay(selector) → τ;  replay(pool oracle) → oracle τ;  pool diagnostics
                    cached in <out>/replay/<benchmark>__<label>.json, keyed by the checkpoint's files

A variant is a label, a checkpoint and the selector to run on its pool (by default the one the
checkpoint was trained with, else `native`). `LABEL=DIR:native` runs a DRelay-trained drafter with
native selection, which separates what the selector adds from what joint training did to the drafter.

A variant's selector may also be a head installed beside the checkpoint (`drelay heads add`), found as
`drelay generate --method` finds it (`pipelines.common.methods.check_selector_weights`).

Summary: τ per benchmark per variant, the mean over benchmarks, and each variant's ratio to the
baseline: mean τ(variant) / mean τ(baseline), and per benchmark τ(variant) / τ(baseline), with the
share of the baseline's oracle headroom; every ratio with its paired-bootstrap interval over prompts
and a verdict (pipelines/eval/compare_intervals.py).
"""

from __future__ import annotations

import re
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from drelay_model.errors import DRelayError
from drelay_model.selectors import SelectionContext, default_registry
from pipelines.common.checkpoint_refs import resolve_ref
from pipelines.common.methods import MethodSpec, check_selector_weights, trained_selector
from pipelines.common.paths import NAME_PATTERN
from pipelines.common.store import JsonStore
from pipelines.data.eval_sets import BenchmarkPrompt
from pipelines.eval.prompts import PromptEncoder
from pipelines.eval.compare_intervals import Bootstrap, VariantIntervals, compare_intervals, headroom, interval_table
from pipelines.eval.results import PROMPT_COUNTS, CellResult, ReplayResult, fingerprint
from pipelines.eval.runner import MethodUnderTest, checkpoint_identity, replay_cell

_LABEL = re.compile(NAME_PATTERN)


@dataclass(frozen=True)
class Variant:
    """label: a column of the table; spec: the selector (a registry name) over a drafter checkpoint."""

    label: str
    spec: MethodSpec

    @property
    def checkpoint(self) -> str:
        return self.spec.checkpoint

    @property
    def selector(self) -> str:
        return self.spec.name


def parse_variant(text: str) -> Variant:
    """`LABEL=DIR` or `LABEL=DIR:SELECTOR` → Variant (DIR a checkpoint directory, `DIR@COMMIT` or `models:/…`; SELECTOR a rule,
    the selector DIR was trained with, or a head installed in `DIR/heads/` by `drelay heads add`)."""
    label, eq, rest = text.partition("=")
    if not eq or not rest:
        raise DRelayError(f"--variant {text!r}: expected LABEL=DIR or LABEL=DIR:SELECTOR")
    if not _LABEL.match(label):
        raise DRelayError(f"--variant {text!r}: label must be 1–64 of [A-Za-z0-9._+-], starting with a letter or digit")
    path, selector = rest, None
    if not Path(rest).is_dir() and ":" in rest and "/" not in rest.rpartition(":")[2]:  # models:/… has a ':' too
        path, _, selector = rest.rpartition(":")
    try:  # FOLDER@COMMIT or models:/… → a local folder
        path = resolve_ref(path)
    except DRelayError as exc:
        raise DRelayError(f"--variant {label}: {exc}") from None
    if not Path(path).is_dir():
        raise DRelayError(f"--variant {label}: checkpoint directory '{path}' not found")
    names = list(default_registry().names())
    if selector is not None and selector not in names:
        raise DRelayError(f"--variant {label}: unknown selector '{selector}' (choose from: {', '.join(names)})")
    selector = selector or trained_selector(path)
    try:  # its own trained selector or a head installed beside it, as `drelay generate --method` finds it
        check_selector_weights(path, selector)
    except DRelayError as exc:
        raise DRelayError(f"--variant {label}: {exc}") from None
    return Variant(label, MethodSpec(selector, path))


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
    """Replay of one variant on one benchmark: the counts of `replay_cell`, in total and per prompt turn
    (they merge exactly across prompts; the bootstrap resamples them), and its pool diagnostics."""

    benchmark: str
    label: str
    fingerprint: str
    replay: ReplayResult
    elapsed_s: float

    @classmethod
    def from_dict(cls, d: dict) -> "VariantCell":
        replay = ReplayResult.from_dict(d["replay"])
        if not replay.per_prompt:
            raise ValueError("a replay cell without per-prompt counts")  # the store replays it again
        return cls(**{**d, "replay": replay})


def replay_store(out_dir: Path) -> JsonStore[VariantCell]:
    """<out>/replay/<benchmark>__<label>.json, written atomically; a stale or torn file is redone."""
    return JsonStore(Path(out_dir) / "replay", VariantCell, lambda cell: cell.label)


def replay_variants(
    target,
    variants: Sequence[Variant],
    prompts: Mapping[str, Sequence[BenchmarkPrompt]],
    ar_cells: Mapping[str, CellResult],
    encoder: PromptEncoder,
    store: JsonStore[VariantCell],
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
                    "per_prompt": PROMPT_COUNTS,
                })  # fmt: skip
                cell = store.load(bench, v.label, fp)
                if cell is None:
                    if method is None:
                        method = MethodUnderTest.load(v.spec, target, label=v.label)
                    cell = _replay_one(target, method, bench, bench_prompts, ar_cells[bench], encoder, fp, progress)
                    store.save(cell)
                cells[(bench, v.label)] = cell
                bar.update(1)
    return cells


@torch.inference_mode()
def select_cost(target, method: MethodUnderTest, prompt_ids: list[int], reps: int = 10) -> dict[str, float]:
    """What the variant's selector costs to run: `params` (its trainable parameters, 0 for rules) and
    `select_ms`, the median ms of `reps` batch-1 selections on one real drafted block (the first
    prompt's context; the latency setting, unlike replay's batched rounds)."""
    drafter, selector = method.drafter, method.selector
    n = len(prompt_ids)
    cache, ctx = target.new_cache(1, n + 1), drafter.new_context_cache(1, n + 1)
    res = target(torch.tensor([prompt_ids], device=target.device), cache, feature_layers=drafter.config.target_layer_ids)
    drafter.extend_context(res.features, ctx)
    anchor = torch.tensor([prompt_ids[-1]], device=target.device)
    block = drafter.draft(anchor, ctx)
    N = selector.capabilities.history_len
    hist = res.features[:, -N:] if N else None
    sctx = SelectionContext(anchor_ids=anchor, anchor_pos=cache.lengths.clone(), row_ids=torch.zeros(1, dtype=torch.long, device=target.device),
                            history=hist, history_mask=torch.ones(hist.shape[:2], dtype=torch.bool, device=target.device) if N else None)  # fmt: skip
    selector.select(block, sctx)  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        selector.select(block, sctx)
        times.append((time.perf_counter() - t0) * 1000)
    return {"params": float(sum(p.numel() for p in selector.parameters())), "select_ms": statistics.median(times)}


def _replay_one(target, method, bench, prompts, ar_cell, encoder, fp, progress) -> VariantCell:
    t0 = time.perf_counter()
    with tqdm(
        total=len(prompts), desc=f"{bench}/{method.name}", unit="prompt", leave=False, disable=not progress, file=sys.stderr
    ) as bar:
        res, _ = replay_cell(target, method, prompts, encoder, ar_cell.outputs, bar=bar)
    return VariantCell(benchmark=bench, label=method.name, fingerprint=fp, replay=res, elapsed_s=time.perf_counter() - t0)


@dataclass
class ComparisonSummary:
    """Flat metrics per variant (`<benchmark>/tau`, `<benchmark>/oracle_tau`, `mean_tau`,
    `mean_oracle_tau`, `ratio_vs_baseline`, `<benchmark>/ratio_vs_baseline`, `headroom_share`, and for
    every variant but the baseline each ratio's `_ci_low` / `_ci_high`), the intervals, and the tables."""

    baseline: str
    benchmarks: list[str]
    metrics: dict[str, dict[str, float]]
    intervals: dict[str, VariantIntervals]
    bootstrap: Bootstrap

    def markdown(self) -> str:
        from pipelines.eval.report import BENCHMARK_LABELS

        labels = list(self.metrics)
        head = ["benchmark", *[f"τ {v}" for v in labels], *[f"{v} ÷ {self.baseline} [95% CI]" for v in self.intervals]]
        costs = all("select_ms" in self.metrics[v] for v in labels)
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for b in [*self.benchmarks, "mean"]:
            key = "mean_tau" if b == "mean" else f"{b}/tau"
            name = "**mean**" if b == "mean" else BENCHMARK_LABELS.get(b, b)
            row = [name, *[f"{self.metrics[v][key]:.3f}" for v in labels]]
            row += [(iv.mean_ratio if b == "mean" else iv.per_benchmark[b]).format() for iv in self.intervals.values()]
            lines.append("| " + " | ".join(row) + " |")
        extra = " select ms/round | params |" if costs else ""
        lines += ["", "| variant | mean τ | mean oracle τ | τ ÷ oracle τ | coverage @ 1st error | one-edit gain |" + extra,
                  "|---|---|---|---|---|---|" + ("---|---|" if costs else "")]  # fmt: skip
        for v in labels:
            m = self.metrics[v]
            cost = f" {m['select_ms']:.2f} | {int(m['params']):,} |" if costs else ""
            lines.append(f"| {v} | {m['mean_tau']:.3f} | {m['mean_oracle_tau']:.3f} | {m['mean_efficiency']:.3f} | "
                         f"{m['mean_coverage_first_error']:.3f} | {m['mean_one_edit_gain']:.3f} |{cost}")  # fmt: skip
        text = "\n".join(lines) + "\n"
        return text + ("\n" + interval_table(self.baseline, self.intervals, self.bootstrap) if self.intervals else "")

    def as_json(self) -> dict:
        """compare.json's results: the metrics, each variant's verdict, the power figures, the bootstrap."""
        return {
            "metrics": self.metrics,
            "verdicts": {v: iv.verdict for v, iv in self.intervals.items()},
            "power": {v: iv.power() for v, iv in self.intervals.items()},
            "bootstrap": {"resamples": self.bootstrap.resamples, "seed": self.bootstrap.seed, "level": self.bootstrap.level},
        }


def summarize(
    cells: Mapping[tuple[str, str], VariantCell],
    variants: Sequence[Variant],
    benchmarks: Sequence[str],
    baseline: str,
    costs: Mapping[str, dict[str, float]] | None = None,
    *,
    bootstrap: Bootstrap,
) -> ComparisonSummary:
    """Means over benchmarks (each benchmark weighs the same, as in the paper's Avg. column), each
    variant's `select_cost` when given, and every ratio's paired-bootstrap interval."""
    metrics: dict[str, dict[str, float]] = {}
    for v in variants:
        m: dict[str, float] = {}
        for b in benchmarks:
            r = cells[(b, v.label)].replay
            m.update({f"{b}/tau": r.tau, f"{b}/oracle_tau": r.oracle_tau, f"{b}/coverage_first_error": r.diagnostics.coverage_first_error,
                      f"{b}/one_edit_gain": r.diagnostics.one_edit_gain})  # fmt: skip
        for key in ("tau", "oracle_tau", "coverage_first_error", "one_edit_gain"):
            m[f"mean_{key}"] = sum(m[f"{b}/{key}"] for b in benchmarks) / len(benchmarks)
        m["mean_efficiency"] = m["mean_tau"] / m["mean_oracle_tau"] if m["mean_oracle_tau"] else 0.0
        m.update((costs or {}).get(v.label, {}))
        metrics[v.label] = m
    base = metrics[baseline]
    for m in metrics.values():
        m["ratio_vs_baseline"] = m["mean_tau"] / base["mean_tau"] if base["mean_tau"] else 0.0
        m["headroom_share"] = headroom(m["mean_tau"], base["mean_tau"], base["mean_oracle_tau"])
        for b in benchmarks:
            m[f"{b}/ratio_vs_baseline"] = m[f"{b}/tau"] / base[f"{b}/tau"] if base[f"{b}/tau"] else 0.0
    replays = {key: cell.replay for key, cell in cells.items()}
    intervals = compare_intervals(replays, list(metrics), benchmarks, baseline, metrics, bootstrap)
    for label, iv in intervals.items():
        metrics[label].update(iv.metrics())
    return ComparisonSummary(baseline, list(benchmarks), metrics, intervals, bootstrap)


__all__ = [
    "ComparisonSummary",
    "Variant",
    "VariantCell",
    "parse_variants",
    "replay_store",
    "replay_variants",
    "select_cost",
    "summarize",
]
