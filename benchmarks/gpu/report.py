"""The GPU check's report: every step's JSON record (benchmarks/gpu_check.sh) → report.md + results.json.

    python benchmarks/gpu/report.py WORK_DIR OUT_DIR [--seconds N]

Exit 0 when every step passed or was skipped, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ORDER = ("env", "tests", "lossless", "accepted", "kernels", "graphs", "joint_step", "joint_step_8b", "timing")


def _status(rec: dict) -> str:
    if "skipped" in rec:
        return f"skipped: {rec['skipped']}"
    if "error" in rec:
        return f"FAILED: {rec['error']}"
    return "ok" if rec.get("ok") else "FAILED"


def _details(step: str, r: dict) -> list[str]:
    """A few lines per step with the numbers that matter (the rest is in results.json)."""
    if step == "env":
        return [f"- {k}: {v}" for k, v in r.items()]
    if step == "tests":
        lines = [f"- {r.get('tests')} tests: {r.get('failures')} failures, {r.get('errors')} errors, {r.get('skipped')} skipped"]
        return lines + [f"- failed: {name}" for name in r.get("failed", [])]
    if step == "lossless":
        head = ["| method / dtype | lossless | rows = AR | τ |", "|---|---|---|---|"]
        return [
            f"target {r['target']}, {r['prompts']} prompts × {r['new_tokens']} tokens",
            "",
            *head,
            *(f"| {m} | {v['lossless']} | {v['rows_equal_to_ar']} | {v['tau']} |" for m, v in r["methods"].items()),
        ]
    if step == "accepted":
        head = ["| dtype | accepted as scheduled | tokens = AR | lengths after every round | cache vs fresh prefill | τ |"]
        rows = [
            f"| {d} | {v['accepted_as_scheduled']} | {v['tokens_equal_ar']} | {v['lengths_after_every_round']} | "
            f"{v.get('kv_vs_fresh_prefill_rel', '–')} | {v['tau']} |"
            for d, v in r["dtypes"].items()
        ]
        hists = [f"- {d} accept histogram (drafts 0..H): {v['accept_hist']}" for d, v in r["dtypes"].items()]
        return [f"target {r['target']}", "", *head, "|---|---|---|---|---|---|", *rows, "", *hists]
    if step == "kernels":
        head = [
            "| batch | attention err | attention triton / torch ms | walk same picks | walk triton / torch ms | "
            "selector same paths | selector triton / torch ms |",
            "|---|---|---|---|---|---|---|",
        ]
        rows = [
            f"| {b} | {v['attention']['max_abs_err']:.2e} | {v['attention']['triton_ms']} / {v['attention']['torch_ms']} | "
            f"{v['walk']['same_picks']} | {v['walk']['triton_ms']} / {v['walk']['torch_ms']} | {v['selector']['same_paths']} | "
            f"{v['selector']['triton_ms']} / {v['selector']['torch_ms']} |"
            for b, v in r["batches"].items()
        ]
        return [f"selector parameters: {r['selector_params']:,}", "", *head, *rows]
    if step == "graphs":
        head = [
            "| batch | replay = eager (3 inputs) | eager ms | replay ms | = engine draft | draft ms | DRelay select ms | select ÷ draft |",
            "|---|---|---|---|---|---|---|---|",
        ]
        rows = [
            f"| {b} | {all(i['bitwise_equal'] for i in v['inputs'])} | {v['eager_ms']} | {v['replay_ms']} | "
            f"{sum(i['vs_engine_draft']['bitwise_equal'] for i in v['inputs'])}/{len(v['inputs'])} | "
            f"{v.get('draft_ms', '—')} | {v.get('select_ms', '—')} | {v.get('select_per_draft', float('nan')):.2f} |"
            for b, v in r["batches"].items()
        ]
        return [f"mode: {r['mode']}", "", *head, *rows]
    if step in ("joint_step", "joint_step_8b"):
        return [
            f"- activations {r['measured_activations_gib']} GiB measured vs {r['plan_activations_gib']} GiB planned "
            f"(×{r['activations_measured_over_plan']}, attention path {r['plan_attention']}); by stage "
            f"{r['measured_stages_gib']} GiB measured, {r['plan_stages_gib']} GiB planned",
            f"- peak {r['measured_peak_gib']} GiB vs plan {r['plan_total_gib']} GiB (×{r['peak_measured_over_plan']}); "
            f"resident between steps {r['resident_gib']} GiB",
            f"- params {r['params']}; loss {r['loss']}; step seconds {r['step_seconds']}",
            f"- plan components (GiB): {r['plan_components_gib']}",
            f"- plan activation stages (GiB): {r['plan_activation_stages_gib']}",
        ]
    if step == "timing":
        return [f"- {line}" for line in r]
    return [f"```\n{json.dumps(r, indent=2)}\n```"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="report.py", description=__doc__.splitlines()[0])
    ap.add_argument("work")
    ap.add_argument("out")
    ap.add_argument("--seconds", type=int, default=0)
    args = ap.parse_args(argv)
    work, out = Path(args.work), Path(args.out)
    records = {}
    for step in ORDER:
        path = work / f"{step}.json"
        records[step] = (
            json.loads(path.read_text())
            if path.is_file()
            else {"step": step, "ok": False, "error": "no record (the step did not finish)"}
        )
    if "timing" not in {p.stem for p in work.glob("*.json")}:
        records["timing"] = {"step": "timing", "ok": True, "skipped": "not run (no CUDA device or no time left)"}
    ok = all(r.get("ok") for r in records.values())
    failed = sum(not r.get("ok") for r in records.values())
    skipped = sum("skipped" in r for r in records.values())
    verdict = f"{'PASSED' if ok else 'FAILED'}: {len(records) - failed - skipped} passed, {failed} failed, {skipped} skipped"
    lines = [
        f"# GPU check {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {verdict}, {args.seconds} s",
        "",
        f"commit: {records['env'].get('result', {}).get('commit', 'unknown (no env record)')}",
        "",
        "| step | status | seconds |",
        "|---|---|---|",
    ]
    lines += [f"| {s} | {_status(r)} | {r.get('seconds', '')} |" for s, r in records.items()]
    for step, rec in records.items():
        if "result" in rec:
            try:
                lines += ["", f"## {step}", "", *_details(step, rec["result"])]
            except (KeyError, TypeError, ValueError) as exc:  # a partial result: show it raw
                lines += ["", f"## {step}", "", f"(unexpected result: {exc})", "```", json.dumps(rec["result"], indent=2), "```"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(records, indent=2) + "\n")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
