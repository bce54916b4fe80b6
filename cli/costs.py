"""`drelay costs`: measure (or show) the round cost surface that cost-aware verification length uses.

The table prints, at each batch size b, an AR step's time and, for a round verifying h drafts per
row, its time relative to that AR step: the tokens per row such a round must commit to break even."""

from __future__ import annotations

import argparse
import dataclasses
import json

from drelay_model.decoding.cost_policy import DEFAULT_MAX_BATCH, RoundCosts, cached_costs, costs_path
from drelay_model.errors import DRelayError
from cli.options import add_target
from pipelines.common.methods import NATIVE, load_method, load_target_spec, method_names, resolve_method


def add_parser(sub) -> None:
    p = sub.add_parser("costs", help="measure the round cost surface for cost-aware verification", description=__doc__)
    add_target(p)
    p.add_argument("--method", default=NATIVE, help=f"selector: {', '.join(method_names()[1:])}")
    p.add_argument("--checkpoint", help="drafter checkpoint directory (default: the one bundled for the target)")
    p.add_argument(
        "--random-drafter", action="store_true", help="an untrained drafter (timing only: costs do not depend on training)"
    )
    p.add_argument("--reps", type=int, default=9, help="interleaved repetitions whose median each term is (1–99; default 9)")
    p.add_argument(
        "--max-batch", type=int, default=DEFAULT_MAX_BATCH, help=f"measure batch sizes 1 … this (default {DEFAULT_MAX_BATCH})"
    )
    p.add_argument("--batch", type=int, nargs="+", help="batch sizes to show (default: the measured ones; others interpolated)")
    p.add_argument("--show", action="store_true", help="print the cached surface without measuring")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    spec = resolve_method(args.method, target_spec=args.target, checkpoint=args.checkpoint, random_drafter=args.random_drafter)
    if spec.is_ar:
        raise DRelayError("--method ar has no drafting costs; choose a selector")
    if not 1 <= args.reps <= 99:
        raise DRelayError(f"--reps must be in [1, 99], got {args.reps}")
    if not 1 <= args.max_batch <= 1024 or any(not 1 <= b <= 1024 for b in args.batch or ()):
        raise DRelayError("--max-batch and --batch must be in [1, 1024]")
    target = load_target_spec(args.target, device=args.device, dtype=args.dtype)
    drafter, selector = load_method(spec, target)
    if args.show and not costs_path(target, drafter, selector, method=spec.name).exists():
        raise DRelayError(f"no cached costs for {args.target}/{args.method}; run without --show to measure them")
    max_batch = max([args.max_batch, *(args.batch or ())])
    costs = cached_costs(
        target, drafter, selector, target_spec=args.target, method=spec.name, remeasure=not args.show, reps=args.reps,
        max_batch=1 if args.show else max_batch,
    )  # fmt: skip
    if args.json:
        print(json.dumps(dataclasses.asdict(costs)))
        return 0
    print("\n".join(surface_table(costs, args.batch or costs.batch_sizes)))
    return 0


def surface_table(costs: RoundCosts, batches) -> list[str]:
    """Lines of the table: per batch size b, the AR step (ms, and ms per row) and a round verifying h
    drafts per row (drafting h slots, the selector deciding them, verifying 1 + h) ÷ the AR step."""
    H = costs.max_slots
    hs = [h for h in (1, 2, 4, 8, H) if 1 <= h <= H]
    hs = sorted(set(hs))
    lines = [
        f"batch sizes measured: {', '.join(map(str, costs.batch_sizes))} (others linear in b between them)",
        "round verifying h drafts per row ÷ an AR step at the same batch size (the tokens per row it must commit to pay)",
        f"{'b':>5} {'AR ms':>8} {'ms/row':>7} " + " ".join(f"{f'h={h}':>6}" for h in hs),
    ]
    for b in batches:
        ar = costs.verify(1, b)
        ratios = [(costs.draft_ms(h, h, b) + costs.verify(1 + h, b)) / ar for h in hs]
        lines.append(f"{b:>5} {ar:>8.1f} {ar / b:>7.2f} " + " ".join(f"{r:>6.2f}" for r in ratios))
    return lines
