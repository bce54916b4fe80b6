"""`drelay costs`: measure (or show) the round cost curve that cost-aware verification length uses."""

from __future__ import annotations

import argparse
import dataclasses
import json

from drelay_model.errors import DRelayError
from pipelines.cli.options import add_target
from pipelines.common.costs import costs_path, verify_costs
from pipelines.common.methods import NATIVE, load_method, load_target_spec, method_names, resolve_method


def add_parser(sub) -> None:
    p = sub.add_parser("costs", help="measure the per-round cost curve for cost-aware verification", description=__doc__)
    add_target(p)
    p.add_argument("--method", default=NATIVE, help=f"selector: {', '.join(method_names()[1:])}")
    p.add_argument("--checkpoint", help="drafter checkpoint directory (default: the one bundled for the target)")
    p.add_argument(
        "--random-drafter", action="store_true", help="an untrained drafter (timing only: costs do not depend on training)"
    )
    p.add_argument("--reps", type=int, default=9, help="interleaved repetitions whose median each term is (1–99; default 9)")
    p.add_argument("--show", action="store_true", help="print the cached curve without measuring")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    spec = resolve_method(args.method, target_spec=args.target, checkpoint=args.checkpoint, random_drafter=args.random_drafter)
    if spec.is_ar:
        raise DRelayError("--method ar has no drafting costs; choose a selector")
    if not 1 <= args.reps <= 99:
        raise DRelayError(f"--reps must be in [1, 99], got {args.reps}")
    target = load_target_spec(args.target, device=args.device, dtype=args.dtype)
    if args.show and not costs_path(args.target, spec, target.embed_weight.device.type, packed=target.packed).exists():
        raise DRelayError(f"no cached costs for {args.target}/{args.method}; run without --show to measure them")
    drafter, selector = load_method(spec, target)
    costs = verify_costs(target, drafter, selector, target_spec=args.target, spec=spec, remeasure=not args.show, reps=args.reps)
    if args.json:
        print(json.dumps(dataclasses.asdict(costs)))
        return 0
    print(
        f"drafter block {costs.block_ms:.1f} ms + LM head {costs.head_ms:.2f} ms/slot + select {costs.select_ms:.1f} ms"
        f" (+ {costs.select_slot_ms:.2f} ms per further decided slot) + context extension {costs.extend_ms:.1f} ms"
    )
    if costs.draft_slots_ms:
        print("draft(h slots) ms: " + "  ".join(f"{h}:{ms:.1f}" for h, ms in enumerate(costs.draft_slots_ms, start=1)))
    print("verify(t) ms: " + "  ".join(f"{t}:{ms:.1f}" for t, ms in enumerate(costs.verify_ms, start=1)))
    return 0
