"""Do two `drelay compare` runs on different prompt subsets agree? For every ratio both report (per
benchmark and the mean, each variant against the baseline), whether each run's point ratio lies
inside the other run's 95% interval — the check that the intervals mean what they say.

    .venv/bin/python analysis/compare_agreement.py outputs/compare/RUN_A outputs/compare/RUN_B

Reads each run's compare.json; prints a markdown table and the count of ratios that agree both ways.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from drelay_model.errors import DRelayError  # noqa: E402

RATIO = "ratio_vs_baseline"


def read_ratios(folder: Path) -> dict[tuple[str, str], tuple[float, float, float]]:
    """{(variant, benchmark or 'mean'): (ratio, ci_low, ci_high)} from folder/compare.json."""
    path = folder / "compare.json"
    if not path.is_file():
        raise DRelayError(f"{folder}: no compare.json (run `drelay compare` into it first)")
    doc = json.loads(path.read_text())
    out = {}
    for variant, metrics in doc["metrics"].items():
        if variant == doc["baseline"]:
            continue
        for key, value in metrics.items():
            if not key.endswith(RATIO):
                continue
            name = key[: -len(RATIO)].rstrip("/") or "mean"
            low, high = metrics.get(f"{key}_ci_low"), metrics.get(f"{key}_ci_high")
            if low is not None and high is not None:
                out[(variant, name)] = (value, low, high)
    return out


def agreement(a: dict, b: dict) -> list[tuple[str, str, tuple, tuple, bool, bool]]:
    """Rows (variant, name, a's (ratio, low, high), b's, a's ratio inside b's interval, b's inside a's)."""
    rows = []
    for key in a:
        if key in b:
            (ra, la, ha), (rb, lb, hb) = a[key], b[key]
            rows.append((*key, a[key], b[key], lb <= ra <= hb, la <= rb <= ha))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_a", type=Path)
    p.add_argument("run_b", type=Path)
    args = p.parse_args()
    rows = agreement(read_ratios(args.run_a), read_ratios(args.run_b))
    if not rows:
        raise DRelayError("the two runs share no variant ratio with an interval")
    fmt = lambda r: f"{r[0]:.3f} [{r[1]:.3f}, {r[2]:.3f}]"  # noqa: E731
    print(f"| variant | ratio | {args.run_a.name} | {args.run_b.name} | A in B's interval | B in A's interval |")
    print("|---|---|---|---|---|---|")
    for variant, name, ra, rb, a_in_b, b_in_a in rows:
        print(f"| {variant} | {name} | {fmt(ra)} | {fmt(rb)} | {'yes' if a_in_b else 'no'} | {'yes' if b_in_a else 'no'} |")
    both = sum(a_in_b and b_in_a for *_, a_in_b, b_in_a in rows)
    print(f"\n{both} of {len(rows)} ratios agree both ways")


if __name__ == "__main__":
    from cli import guarded

    raise SystemExit(guarded(main, Path(__file__).name))
