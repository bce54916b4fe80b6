"""The comparison table in the layout of the paper's Table 1, from per-method flat metrics.

Input: one `MethodRow` per method — its label and the flat metrics of its MLflow method run
(`<benchmark>/speedup`, `<benchmark>/tau`, optional `_std`, `mean_speedup`, `mean_tau`, …; see
pipelines/eval/metrics.py). The same rows come from an evaluation in memory or from MLflow
(`rows_from_mlflow`), so `drelay eval` and `drelay report` print the same table.

Layout: one row per speculative method (AR is the reference, S = τ = 1, and is left out);
per benchmark `S` then `τ`; `Avg.` = the arithmetic mean over the listed benchmarks. A number with
its 95% interval (`_ci_low`, `_ci_high`, pipelines/eval/prompt_intervals.py) reads `1.21× [1.15, 1.27]`;
at T > 0 each number is mean ± std over seeds. A second table gives each method's relative improvement over each
other in mean S and mean τ: (a / b − 1) × 100 %.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

BENCHMARK_LABELS = {
    "gsm8k": "GSM8K", "math500": "MATH-500", "aime25": "AIME25", "humaneval": "HumanEval",
    "mbpp": "MBPP", "livecodebench": "LCB", "mt_bench": "MT-Bench", "alpaca": "Alpaca",
}  # fmt: skip
DIAGNOSTIC_COLUMNS = (
    ("mean_tau", "τ"), ("mean_tau_replay", "replay τ"), ("mean_oracle_tau", "oracle τ"),
    ("mean_efficiency", "efficiency"), ("mean_coverage_first_error", "coverage@1st err"),
    ("mean_one_edit_gain", "one-edit gain"),
)  # fmt: skip


@dataclass
class MethodRow:
    label: str
    metrics: dict[str, float]


@dataclass
class ComparisonTable:
    """Rows to compare over `benchmarks`; `notes` are printed under the table."""

    benchmarks: tuple[str, ...]
    rows: list[MethodRow]
    notes: list[str] = field(default_factory=list)


def _fmt(m: dict[str, float], key: str, *, times: bool) -> str:
    """`1.21× ± 0.03 [1.15, 1.27]`: the value, ± its std over seeds when non-zero, its 95% interval when logged."""
    v = m.get(key)
    if v is None:
        return "–"
    unit = "×" if times else ""
    text = f"{v:.2f}{unit}"
    std = m.get(f"{key}_std")
    text += f" ± {std:.2f}" if std else ""
    low, high = m.get(f"{key}_ci_low"), m.get(f"{key}_ci_high")
    return text + (f" [{low:.2f}, {high:.2f}]" if low is not None and high is not None else "")


def interval_note(bootstrap: dict[str, object]) -> str:
    """The note under a table whose numbers carry intervals; `bootstrap`: its `resamples` and `seed`."""
    return (
        "[low, high]: 95% interval, bootstrap over each benchmark's prompts (paired with AR for S; Avg.: every "
        f"benchmark resampled at once), {bootstrap['resamples']} resamples, seed {bootstrap['seed']}."
    )


def markdown_table(table: ComparisonTable) -> str:
    """Table 1 layout: Method | <bench> S | <bench> τ | … | Avg. S | Avg. τ."""
    head = ["Method"]
    for b in table.benchmarks:
        head += [f"{BENCHMARK_LABELS.get(b, b)} S", f"{BENCHMARK_LABELS.get(b, b)} τ"]
    head += ["Avg. S", "Avg. τ"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in table.rows:
        cells = [row.label]
        for b in table.benchmarks:
            cells += [_fmt(row.metrics, f"{b}/speedup", times=True), _fmt(row.metrics, f"{b}/tau", times=False)]
        cells += [_fmt(row.metrics, "mean_speedup", times=True), _fmt(row.metrics, "mean_tau", times=False)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + [""] + [f"{n}  " for n in table.notes])


def csv_rows(table: ComparisonTable) -> list[dict[str, object]]:
    """One dict per method: <bench>_S, <bench>_tau (each with _std, _ci_low, _ci_high), avg_S, avg_tau (with _ci_…)."""
    out = []
    for row in table.rows:
        columns = [(f"{b}/{key}", f"{b}_{col}") for b in table.benchmarks for key, col in (("speedup", "S"), ("tau", "tau"))]
        columns += [("mean_speedup", "avg_S"), ("mean_tau", "avg_tau")]
        d: dict[str, object] = {"method": row.label}
        for key, col in columns:
            for suffix in ("", "_std", "_ci_low", "_ci_high"):
                if suffix != "_std" or not key.startswith("mean_"):
                    d[f"{col}{suffix}"] = row.metrics.get(f"{key}{suffix}")
        out.append(d)
    return out


def relative_improvements(rows: Sequence[MethodRow]) -> list[dict[str, object]]:
    """Every ordered pair (a, b), a ≠ b: mean S and mean τ of a relative to b, in percent."""
    out = []
    for a in rows:
        for b in rows:
            if a is b:
                continue
            d: dict[str, object] = {"method": a.label, "over": b.label}
            for key, name in (("mean_speedup", "S"), ("mean_tau", "tau")):
                va, vb = a.metrics.get(key), b.metrics.get(key)
                d[f"mean_{name}"], d[f"over_mean_{name}"] = va, vb
                d[f"rel_{name}_pct"] = 100.0 * (va / vb - 1.0) if va is not None and vb else None
            out.append(d)
    return out


def markdown_relative(rows: Sequence[MethodRow]) -> str:
    """Matrix: row method vs column method, 'ΔS% / Δτ%' of mean S and mean τ."""
    if len(rows) < 2:
        return "(one method: no pairwise comparison)"
    rel = {(d["method"], d["over"]): d for d in relative_improvements(rows)}
    labels = [r.label for r in rows]
    lines = ["| mean S / mean τ vs → | " + " | ".join(labels) + " |", "|" + "---|" * (len(labels) + 1)]
    for a in labels:
        cells = []
        for b in labels:
            d = rel.get((a, b))
            if d is None:
                cells.append("—")
            else:
                s, t = d["rel_S_pct"], d["rel_tau_pct"]
                cells.append("–" if s is None or t is None else f"{s:+.1f}% / {t:+.1f}%")
        lines.append(f"| {a} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_diagnostics(rows: Sequence[MethodRow]) -> str | None:
    """Greedy replay diagnostics, means over benchmarks; None when no row has them."""
    if not any("mean_tau_replay" in r.metrics for r in rows):
        return None
    lines = ["| Method | " + " | ".join(c for _, c in DIAGNOSTIC_COLUMNS) + " |", "|" + "---|" * (len(DIAGNOSTIC_COLUMNS) + 1)]
    for r in rows:
        vals = [f"{r.metrics[k]:.3f}" if k in r.metrics else "–" for k, _ in DIAGNOSTIC_COLUMNS]
        lines.append(f"| {r.label} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def render(table: ComparisonTable, title: str = "") -> str:
    parts = [f"## {title}\n" if title else "", markdown_table(table), "\n### Relative improvement (row over column)\n",
             markdown_relative(table.rows)]  # fmt: skip
    diag = markdown_diagnostics(table.rows)
    if diag:
        parts += ["\n### Greedy replay diagnostics (mean over benchmarks)\n", diag]
    return "\n".join(parts) + "\n"


def write_report(table: ComparisonTable, out_dir: str | Path, title: str = "") -> list[Path]:
    """report.md, report.csv (Table 1 layout) and relative.csv; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = out / "report.md"
    md.write_text(render(table, title))
    paths = [md]
    for name, rows in (("report.csv", csv_rows(table)), ("relative.csv", relative_improvements(table.rows))):
        path = out / name
        with path.open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(rows[0]) if rows else ["method"])
            writer.writeheader()
            writer.writerows(rows)
        paths.append(path)
    return paths
