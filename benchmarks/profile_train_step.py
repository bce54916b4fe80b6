"""Where a CPU training step's time goes: target features, drafter (+ scout) forward, backward, optimizer.

    .venv/bin/python benchmarks/profile_train_step.py [--anchors 32 64 96] [--threads 1] [--seqs 1]
        [--checkpoint outputs/train/smollm2-135m-base/drafter] [--steps 5]

One process, no Ray: the shipped smollm2-135m config's drafter (from --checkpoint if given, else
fresh), random training batches of --seqs sequences, --steps timed steps after 2 warm-up steps, for
each --anchors value and for float32 vs bfloat16-autocast target features. Prints seconds per part
and blocks (anchors) per second — the number that says how much training signal a CPU second buys.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--anchors", type=int, nargs="+", default=[32, 64, 96])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seqs", type=int, default=1, help="sequences per step")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--checkpoint", help="drafter checkpoint to start from (default: a fresh drafter)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from drelay_model.training.step import DraftTrainModule, training_step
    from drelay_model.target import load_target
    from pipelines.train.config import load_config
    from pipelines.train.data import collate
    from pipelines.train.features import FeatureSource
    from pipelines.train.model_io import build_module
    from pipelines.train.worker import step_config, load_data

    overrides = [f"drafter.init_checkpoint={args.checkpoint}"] if args.checkpoint else []
    cfg = load_config(ROOT / "platform/experiments/smollm2-135m/train.yaml", overrides)
    target = load_target(cfg.target.spec, dtype=torch.float32)
    train, _ = load_data(cfg, target)
    module: DraftTrainModule = build_module(cfg, target, train)
    params = [q for q in module.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    layers = module.drafter.config.target_layer_ids
    print("anchors | features | features s | forward s | backward s | optimizer s | blocks/s")
    for anchors in args.anchors:
        step_cfg = step_config(cfg.model_copy(update={"train": cfg.train.model_copy(update={"anchors_per_seq": anchors})}), 0.5)
        for bf16 in (False, True):
            features = FeatureSource(target, layers, bf16=bf16)
            rng, gen = random.Random(0), torch.Generator().manual_seed(0)
            totals, blocks = [0.0] * 4, 0
            for i in range(args.steps + 2):
                batch = rng.sample(train, args.seqs)
                ids, mask = collate(batch)
                t0 = time.perf_counter()
                feats = features(batch)
                t1 = time.perf_counter()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = training_step(module, module, ids, mask, feats, step_cfg, gen)
                t2 = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                out.loss.backward()
                t3 = time.perf_counter()
                optimizer.step()
                t4 = time.perf_counter()
                if i >= 2:
                    totals = [a + b for a, b in zip(totals, (t1 - t0, t2 - t1, t3 - t2, t4 - t3))]
                    blocks += int(out.metrics["anchors"])
            parts = " | ".join(f"{x / args.steps:.3f}" for x in totals)
            print(f"{anchors:>7} | {'bf16' if bf16 else 'fp32'} | {parts} | {blocks / sum(totals):.1f}", flush=True)


if __name__ == "__main__":
    from cli import guarded

    raise SystemExit(guarded(main, Path(__file__).name))
