"""The paired serve benchmark as plain logic (no HTTP, no Ray, no MLflow): which leg runs when, how legs
become levels, the B ÷ A ratios and the printed report.

A pair is A (the baseline, the first `--config`/`--url`) and B (the second). At each concurrency level
the two endpoints alternate in ABBA order, `rounds` legs each:

    rounds 2:  A B B A          rounds 4:  A B B A A B B A

so a drift of the machine's speed that is linear over the level lands on A's and B's legs alike (their
legs' mean start times coincide), and neither endpoint always runs first. Leg r of A and leg r of B ask
the same prompts. A level's numbers pool its legs (`LevelResult.merged`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipelines.common.intervals import MIN_PAIRS

TAGS = ("A", "B")
# the ratios reported per level: B's value ÷ A's (> 1 on tokens/s: B is faster; < 1 on p99: B is faster)
RATIO_KEYS = ("tokens_per_s", "latency_p99_s", "ttft_p99_s")
# the client's TTFT in parts (`bench.TTFT_PARTS` + the serving path), as the reports name them
TTFT_PART_NAMES = {"queue": "queue", "prefill": "prefill", "first_round": "first round", "serving": "serving"}


@dataclass(frozen=True)
class Endpoint:
    """One side of the benchmark, resolved and reachable."""

    tag: str  # "A" (the baseline) or "B"
    label: str  # what reports call it: the config's model_id, or the served model of a --url
    url: str  # base URL with the route prefix (http://host:port[/prefix]); requests go to {url}/v1/…
    model: str  # the `model` field of every request
    method: str  # decoding method ("external" for a server that is not ours)
    source: str  # the --config path or the --url given


@dataclass(frozen=True)
class Leg:
    concurrency: int
    endpoint: int  # index into the endpoints (0 = A)
    round: int  # 0 … rounds-1; also selects the leg's prompts


def leg_schedule(levels: list[int], n_endpoints: int, rounds: int) -> list[Leg]:
    """Every leg in run order: level by level; within a level, round r runs A then B when r is even
    and B then A when r is odd (one endpoint: its `rounds` legs)."""
    assert n_endpoints in (1, 2) and rounds >= 1
    legs = []
    for c in levels:
        for r in range(rounds):
            order = range(n_endpoints) if r % 2 == 0 else reversed(range(n_endpoints))
            legs += [Leg(c, e, r) for e in order]
    return legs


def order_name(n_endpoints: int, rounds: int) -> str:
    """The per-level order as letters, e.g. 'ABBA' (for the run's parameters and the report)."""
    return "".join(TAGS[leg.endpoint] for leg in leg_schedule([1], n_endpoints, rounds))


def ratios(a: dict, b: dict) -> dict[str, float | None]:
    """B ÷ A of each `RATIO_KEYS` value of two level summaries; None where A's value is 0 (no data)."""
    return {f"ratio_{k}": (b[k] / a[k] if a.get(k) else None) for k in RATIO_KEYS}


def _num(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def level_lines(rows: list[dict], endpoints: list[Endpoint], level_ratios: dict | None) -> list[str]:
    """The printed report of one level: a line per endpoint, then the ratios when paired."""
    width = max(len(e.label) for e in endpoints)
    lines = []
    for e, r in zip(endpoints, rows):
        head = f"c={r['concurrency']:<4}" if e.tag == "A" else " " * 6
        lines.append(
            f"{head} {e.tag} {e.label:<{width}}  tok/s {r['tokens_per_s']:7.2f}"
            f"  latency p50/p99 {r['latency_p50_s']:.2f}/{r['latency_p99_s']:.2f} s"
            f"  TTFT p50/p99 {r['ttft_p50_s']:.3f}/{r['ttft_p99_s']:.3f} s"
            f"  τ {_num(r['tau_mean'], '.2f')}  requests {r['requests']} ({r['failures']} failed)"
        )
        if r.get("queue_p50_s") is not None:
            lines.append(f"{'':6}   TTFT p50/p99: " + "  ".join(
                f"{name} {r[f'{part}_p50_s']:.3f}/{r[f'{part}_p99_s']:.3f}" for part, name in TTFT_PART_NAMES.items()
            ) + " s")  # fmt: skip
    if level_ratios is not None:
        lines.append(
            f"{'':6} "
            + "  ".join(f"{name} {_ratio(level_ratios, key)}" for key, name in RATIO_NAMES.items())
            + _pairs(level_ratios)
        )
    return lines


# RATIO_KEYS as printed
RATIO_NAMES = {"tokens_per_s": "B÷A tokens/s", "latency_p99_s": "latency p99", "ttft_p99_s": "TTFT p99"}


def _ratio(level_ratios: dict, key: str) -> str:
    """`1.21× [1.15, 1.27]` (the interval when the level has one, `bench_intervals.py`), `—` without data."""
    value, low, high = (level_ratios.get(f"ratio_{key}{s}") for s in ("", "_ci_low", "_ci_high"))
    if value is None:
        return "—"
    return f"{value:.2f}×" + (f" [{low:.2f}, {high:.2f}]" if low is not None and high is not None else "")


def _pairs(level_ratios: dict) -> str:
    """How many pairs of legs the intervals rest on, or why there are none."""
    n = level_ratios.get("leg_pairs")
    if n is None:
        return ""
    if n < MIN_PAIRS:
        return f"  ({n} pair{'s' if n > 1 else ''} of legs; an interval needs --rounds ≥ {MIN_PAIRS})"
    return f"  (95% intervals over {n} pairs of legs)"


def markdown_table(levels: list[tuple[list[dict], dict | None]], endpoints: list[Endpoint]) -> str:
    """All levels as one Markdown table (docs/serving.md's format): a row per endpoint per level, with
    B ÷ A on B's rows."""
    paired = len(endpoints) == 2
    head = "| endpoint | concurrency | requests (failures) | tokens/s | latency p50 / p99 (s) | TTFT p50 / p99 (s) | τ |"
    head += " B÷A tokens/s | B÷A latency p99 |" if paired else ""
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for rows, rat in levels:
        for e, r in zip(endpoints, rows):
            line = (
                f"| {e.tag} {e.label} | {r['concurrency']} | {r['requests']} ({r['failures']}) | {r['tokens_per_s']:.2f}"
                f" | {r['latency_p50_s']:.2f} / {r['latency_p99_s']:.2f} | {r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f}"
                f" | {_num(r['tau_mean'], '.2f')} |"
            )
            if paired:
                on_b = e.tag == "B" and rat is not None
                line += f" {_ratio(rat, 'tokens_per_s')} | {_ratio(rat, 'latency_p99_s')} |" if on_b else " | |"
            out.append(line)
    return "\n".join(out)


def ttft_table(levels: list[tuple[list[dict], dict | None]], endpoints: list[Endpoint]) -> str | None:
    """The TTFT breakdown of every level as one Markdown table (p50 / p99 seconds of each part: the
    engine's queue wait, prefill and first round, and the serving path's rest of the client's TTFT);
    None when no endpoint reported the split."""
    rows = [(e, r) for level, _ in levels for e, r in zip(endpoints, level) if r.get("queue_p50_s") is not None]
    if not rows:
        return None
    head = (
        "| endpoint | concurrency | TTFT p50 / p99 (s) | " + " | ".join(f"{n} p50 / p99" for n in TTFT_PART_NAMES.values()) + " |"
    )
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for e, r in rows:
        parts = " | ".join(f"{r[f'{p}_p50_s']:.3f} / {r[f'{p}_p99_s']:.3f}" for p in TTFT_PART_NAMES)
        out.append(f"| {e.tag} {e.label} | {r['concurrency']} | {r['ttft_p50_s']:.3f} / {r['ttft_p99_s']:.3f} | {parts} |")
    return "\n".join(out)
