"""What a trained DRelay selector's repairs do, slot by slot, in greedy replay.

For every replayed round, each slot up to and including the first error of the served path is
counted; where the selector chose a pool candidate other than the native argmax (a repair):
    fixed    the repair is the target's token and the native token was not
    broke    the native token was the target's token and the repair is not
    swapped  neither is (harmless: the round ends at this slot either way)
τ with native selection, with the selector, and the pool oracle are printed per prompt, then the
totals and a per-slot table (slots reached, native argmax right, repairs, fixed, broke) — where in
the block the selector acts.

References are the target's greedy continuations cached by `drelay compare` / `drelay eval`
(<out>/cells/<benchmark>__ar.json), so nothing is decoded here.

Run:  .venv/bin/python analysis/trace_repairs.py --checkpoint outputs/train/smollm2-135m-drelay/drafter \\
          --cells outputs/compare/smollm2-135m/cells --benchmark gsm8k --limit 4
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="drafter checkpoint holding a trained drelay selector")
    p.add_argument("--cells", required=True, help="folder with <benchmark>__ar.json (from drelay compare/eval)")
    p.add_argument("--benchmark", default="gsm8k")
    p.add_argument("--limit", type=int, default=4, help="same subset as the run that wrote the cells")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    from pipelines.common.checkpoint_refs import resolve_ref

    args.checkpoint = args.checkpoint and resolve_ref(args.checkpoint)  # FOLDER@COMMIT too
    torch.set_num_threads(args.threads)

    from drelay_model.decoding.replay import replay
    from drelay_model.drafter import load_drafter
    from drelay_model.errors import DRelayError
    from drelay_model.selectors import default_registry
    from drelay_model.target import load_target
    from pipelines.data.eval_sets import load_benchmark
    from pipelines.eval.prompts import encoder_for

    target = load_target(args.target)
    drafter, extra, meta = load_drafter(args.checkpoint, target)
    selector = default_registry().from_checkpoint("drelay", drafter=drafter, tensors=extra, meta=meta)
    cell = Path(args.cells) / f"{args.benchmark}__ar.json"
    if not cell.is_file():
        raise DRelayError(f"--cells: no '{cell}' (run `drelay compare` or `drelay eval` with the same --limit first)")
    outputs = json.loads(cell.read_text())["outputs"]
    encoder = encoder_for(target)
    counts = dict(slots=0, repairs=0, fixed=0, broke=0, swapped=0)
    per_slot = [dict(reached=0, native_right=0, repairs=0, fixed=0, broke=0) for _ in range(drafter.config.num_slots)]

    def on_round(r) -> None:
        base = r.block.cand_ids[0, :, 0]
        for i in range(min(len(r.path), len(r.ref))):
            counts["slots"] += 1
            slot = per_slot[i]
            slot["reached"] += 1
            slot["native_right"] += int(base[i] == r.ref[i])
            if r.path[i] != base[i]:
                counts["repairs"] += 1
                slot["repairs"] += 1
                key = "fixed" if r.path[i] == r.ref[i] else "broke" if base[i] == r.ref[i] else "swapped"
                counts[key] += 1
                if key in slot:
                    slot[key] += 1
            if r.path[i] != r.ref[i]:
                break

    for prompt in load_benchmark(args.benchmark, limit=args.limit):
        for turn, cont in enumerate(outputs[prompt.prompt_id]):
            ids = encoder.encode(prompt.turns[: turn + 1], outputs[prompt.prompt_id][:turn])
            native = replay(target, drafter, [ids], [cont]).tau
            drelay = replay(target, drafter, [ids], [cont], selector=selector, on_round=on_round).tau
            oracle = replay(target, drafter, [ids], [cont], oracle=True).tau
            print(f"{prompt.prompt_id}#{turn}: τ native {native:.3f} · drelay {drelay:.3f} · oracle {oracle:.3f}")
    print(f"{args.benchmark}, slots up to the first error: {counts['slots']}; repairs {counts['repairs']}: "
          f"fixed {counts['fixed']}, broke {counts['broke']}, swapped {counts['swapped']}")  # fmt: skip
    print("slot | reached | native right | repairs | fixed | broke")
    for i, slot in enumerate(per_slot):
        if slot["reached"]:
            print(
                f"{i + 1:>4} | {slot['reached']:>7} | {slot['native_right']:>12} | {slot['repairs']:>7} | {slot['fixed']:>5} | {slot['broke']:>5}"
            )


if __name__ == "__main__":
    from cli import guarded

    raise SystemExit(guarded(main, Path(__file__).name))
