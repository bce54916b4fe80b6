"""Blocks per second of the selector stage (cached blocks) against the steps it replaces, per head.

    .venv/bin/python benchmarks/bench_selector_stage.py [--heads drelay dflash2 dcoco domino dspark]
        [--seqs 2] [--anchors 32] [--steps 4] [--threads 1] [--profile]

One process, no Ray, the bundled drafter (checkpoints/smollm2-135m) on real training sequences.
For each head, interleaved round by round so that load on a shared machine hits all three alike:
  joint    drafter + head trained together (`training_step_backward`, target features on the fly)
  frozen   the drafter frozen, the head trained through the same step (the equal-budget study's protocol)
  cached   the head alone on the same number of blocks read from a block cache (`selector_step_backward`)
Prints median seconds per step, blocks per second and cached ÷ joint, cached ÷ frozen.
`--profile` adds where a cached DRelay step's time goes (Global Read, history read, causal scores,
loss, backward), from torch's profiler.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _module(name: str, target, train_seqs, *, freeze: bool):
    from pipelines.train.config import load_config
    from pipelines.train.model_io import build_module

    extra = ["selector.config={}"] if name != "drelay" else []
    cfg = load_config(
        ROOT / "platform/experiments/smollm2-135m/selector-stage.yaml",
        [f"selector.name={name}", *extra, f"drafter.freeze={str(freeze).lower()}"]
        + ([] if freeze else ["train.stage=joint", "train.early_stop_patience=null"]),
    )
    return cfg, build_module(cfg, target, train_seqs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", nargs="+", default=["drelay", "dflash2", "dcoco", "domino", "dspark"])
    p.add_argument("--seqs", type=int, default=2)
    p.add_argument("--anchors", type=int, default=32)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from drelay_model.target import load_target
    from drelay_model.training.selector_step import selector_step_backward
    from drelay_model.training.step import training_step_backward
    from pipelines.train import block_cache
    from pipelines.train.data import collate
    from pipelines.train.features import FeatureSource
    from pipelines.train.worker import load_data, step_config

    target = load_target("smollm2-135m", device=torch.device("cpu"), dtype="float32")
    cfg0, _ = _module("dflash2", target, [], freeze=True)
    train_seqs, _ = load_data(cfg0, target)
    seqs = train_seqs[: args.seqs * (args.steps + 2)]
    over = [f"train.anchors_per_seq={args.anchors}", f"data.block_cache_shard={args.seqs}"]
    from pipelines.train.config import load_config

    cfg = load_config(ROOT / "platform/experiments/smollm2-135m/selector-stage.yaml", over)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.heads:
            _, frozen = _module(name, target, train_seqs, freeze=True)
            _, joint = _module(name, target, train_seqs, freeze=False)
            feats = FeatureSource(target, frozen.drafter.config.target_layer_ids, None, bf16=True)
            lay = block_cache.layout(cfg, Path(tmp), frozen.drafter, target, seqs)
            if not lay.complete():
                block_cache.build(lay, seqs, frozen.drafter.eval(), feats, cfg, torch.device("cpu"))
            cache = block_cache.load(lay, with_features=True)
            sc = step_config(cfg, 0.5)
            times = {"joint": [], "frozen": [], "cached": []}
            blocks = {"joint": [], "frozen": [], "cached": []}
            gen = torch.Generator().manual_seed(0)
            for step in range(args.steps + 1):
                batch = seqs[step * args.seqs : (step + 1) * args.seqs]
                for kind, module in (("joint", joint), ("frozen", frozen)):
                    t0 = time.perf_counter()
                    ids, mask = collate(batch)
                    out = training_step_backward(module, module, ids, mask, feats(batch), sc, gen, autocast_dtype=torch.bfloat16)
                    times[kind].append(time.perf_counter() - t0)
                    blocks[kind].append(out.metrics["anchors"])
                idx = torch.randperm(len(cache), generator=gen)[: int(blocks["frozen"][-1])]
                t0 = time.perf_counter()
                out = selector_step_backward(frozen.selector, cache.take(idx), sc, autocast_dtype=torch.bfloat16)
                times["cached"].append(time.perf_counter() - t0)
                blocks["cached"].append(len(idx))
            rate = {k: sum(blocks[k][1:]) / sum(times[k][1:]) for k in times}  # the first round warms up
            results[name] = rate
            print(f"{name:8s} " + "  ".join(f"{k} {statistics.median(times[k][1:]):.3f} s/step {rate[k]:7.1f} blocks/s" for k in times)
                  + f"  cached÷joint {rate['cached'] / rate['joint']:.1f}×  cached÷frozen {rate['cached'] / rate['frozen']:.1f}×", flush=True)  # fmt: skip
            if args.profile and name == "drelay":
                _profile(frozen.selector, cache, sc, len(idx))


def _profile(selector, cache, sc, n: int) -> None:
    """Self CPU time of a cached DRelay step by stage (record_function ranges)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from drelay_model.selectors.drelay import objective
    from drelay_model.training.selector_step import selector_inputs

    inputs = selector_inputs(cache.take(torch.arange(n)), selector, sc, torch.device("cpu"))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with record_function("stage: global read + history + causal evidence"):
                ev, _ = selector.evidence(inputs.block, inputs.history, inputs.history_mask)
            with record_function("stage: teacher-forced causal scores"):
                gate, rank = selector.causal.teacher_forced(ev, selector.embed(inputs.anchor_ids), selector.embed(inputs.labels))
            with record_function("stage: loss (Eq. 3 x Eq. 5)"):
                from drelay_model.training import losses

                sel = losses.selector_loss(gate, rank, inputs.block.cand_ids, inputs.labels, inputs.valid)
                w = losses.repair_weights(sel, beta=1.0, floor=0.1, cap=4.0)
                loss = (inputs.valid.float() * w * sel.per_token).sum()
        with record_function("stage: backward"):
            loss.backward()
    del objective
    rows = [e for e in prof.key_averages() if e.key.startswith("stage:")]
    for e in rows:
        print(f"  {e.key:50s} {e.cpu_time_total / 1e3:8.1f} ms")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
