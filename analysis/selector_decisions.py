"""Is a trained DRelay selector better than the native argmax, and how well calibrated is its gate?

    .venv/bin/python analysis/selector_decisions.py --checkpoint outputs/train/smollm2-135m-joint/drafter \
        [--config platform/experiments/smollm2-135m/train-drelay.yaml] [--seqs 32] [--anchors 96]

Held-out conversations (the training config's validation split, never trained on), every eligible
anchor up to --anchors per sequence, teacher-forced decisions exactly as in training (the prefix
memory holds the target's greedy tokens), Eq. 2's rule. Counts over every valid (block, slot):
    native right   pool index 0 (the drafter's argmax) is the target's token
    selector right the chosen candidate is
    fixed / broke / swapped  repairs (k > 0) that turn a wrong native token right / a right one wrong /
                   one wrong token into another
then the same by slot, and by the decision margin m = g + log r_k* of each repair: a threshold
REPAIR iff m > t (the paper's t = 0) changes accuracy by (fixed − broke) of the repairs above t.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BINS = (0.0, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, float("inf"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="drafter checkpoint holding a trained drelay selector")
    p.add_argument(
        "--config", default=str(ROOT / "platform/experiments/smollm2-135m/train-drelay.yaml"), help="run config (data paths)"
    )
    p.add_argument("--seqs", type=int, default=32, help="held-out sequences")
    p.add_argument("--anchors", type=int, default=96, help="anchors per sequence (all eligible up to this many)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    from pipelines.common.checkpoint_refs import resolve_ref

    args.checkpoint = args.checkpoint and resolve_ref(args.checkpoint)  # FOLDER@COMMIT too
    torch.set_num_threads(args.threads)

    from drelay_model.drafter import load_drafter
    from drelay_model.training.step import DraftTrainModule, decision_outcomes, history_windows
    from drelay_model.selectors import default_registry
    from drelay_model.selectors.drelay.causal import repair_margin
    from drelay_model.target import load_target
    from drelay_model.training.anchors import eligible_anchors, make_blocks, sample_uniform_anchors
    from pipelines.train.config import load_config
    from pipelines.train.data import collate
    from pipelines.train.features import target_features
    from pipelines.train.worker import load_data

    cfg = load_config(args.config)
    target = load_target(cfg.target.spec)
    drafter, extra, meta = load_drafter(args.checkpoint, target)
    selector = default_registry().from_checkpoint("drelay", drafter=drafter, tensors=extra, meta=meta)
    module = DraftTrainModule(drafter.eval(), selector.eval())
    _, val = load_data(cfg, target)
    H, gen = drafter.config.num_slots, torch.Generator().manual_seed(0)
    per_slot = {
        k: torch.zeros(H, dtype=torch.long) for k in ("valid", "native", "chosen", "repairs", "fixed", "broke", "swapped")
    }
    by_margin = [dict.fromkeys(("repairs", "fixed", "broke", "swapped"), 0) for _ in BINS[:-1]]
    for seq in val[: args.seqs]:
        ids, mask = collate([seq])
        with torch.no_grad():
            feats = target_features(target, ids, drafter.config.target_layer_ids)
            anchors, ok = sample_uniform_anchors(eligible_anchors(mask), args.anchors, gen)
            blocks = make_blocks(ids, mask, anchors, ok, H)
            labels, valid = blocks.labels.reshape(-1, H), blocks.valid.reshape(-1, H)
            history, hmask = (
                history_windows(feats, anchors, selector.capabilities.history_len)
                if selector.capabilities.history_len
                else (None, None)
            )
            head, _ = module(torch.gather(ids, 1, anchors), anchors, feats, labels, valid)
            block = head.block
            out = selector.forward_train(
                block, anchor_ids=ids.gather(1, anchors).reshape(-1), prefix_tokens=labels, history=history, history_mask=hmask
            )
        outcome = decision_outcomes(out.gate, out.rank, block.cand_ids, labels, valid)
        margin, _ = repair_margin(out.gate, out.rank)
        for k, hits in outcome.items():
            per_slot[k] += hits.sum(dim=0)
        for b, (lo, hi) in enumerate(zip(BINS[:-1], BINS[1:])):
            in_bin = (margin > lo) & (margin <= hi)
            for k in by_margin[b]:
                by_margin[b][k] += int((outcome[k] & in_bin).sum())
    total = {k: int(v.sum()) for k, v in per_slot.items()}
    n = max(total["valid"], 1)
    print(f"{args.checkpoint}: {min(args.seqs, len(val))} held-out sequences, {total['valid']} valid (block, slot) pairs")
    print(f"native right {total['native'] / n:.4f} · selector right {total['chosen'] / n:.4f} · "
          f"repairs {total['repairs']} ({total['repairs'] / n:.2%}): fixed {total['fixed']}, broke {total['broke']}, swapped {total['swapped']}")  # fmt: skip
    print("\nslot | valid | native right | selector right | repairs | fixed | broke")
    for i in range(H):
        s = {k: int(v[i]) for k, v in per_slot.items()}
        v = max(s["valid"], 1)
        print(
            f"{i + 1:>4} | {s['valid']:>5} | {s['native'] / v:>12.3f} | {s['chosen'] / v:>14.3f} | {s['repairs']:>7} | {s['fixed']:>5} | {s['broke']:>5}"
        )
    print("\nrepair margin m | repairs | fixed | broke | swapped | selector right if REPAIR needs m > lower bound")
    for b, (lo, hi) in enumerate(zip(BINS[:-1], BINS[1:])):
        m = by_margin[b]
        acc = (total["native"] + sum(x["fixed"] - x["broke"] for x in by_margin[b:])) / n
        print(f"({lo:g}, {hi:g}] | {m['repairs']:>7} | {m['fixed']:>5} | {m['broke']:>5} | {m['swapped']:>7} | {acc:.4f}")


if __name__ == "__main__":
    from cli import guarded

    raise SystemExit(guarded(main, Path(__file__).name))
