"""DRelay's inference attention: the reference `null_attention` vs the fused SDPA path.

Times Global Read's candidate read (H·K queries × H·K keys + the null key, prior and relative bias)
and the whole select phase of the bundled checkpoint, both ways, alternating call by call so a busy
machine slows both alike; prints medians and the ratio, and checks the two paths agree.

Run:  .venv/bin/python benchmarks/bench_attention.py [--reps 60] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cli import guarded  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=60)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = p.parse_args(argv)
    if args.reps < 2 or args.threads < 1:
        p.error("--reps must be ≥ 2 and --threads ≥ 1")
    torch.set_num_threads(args.threads)
    import drelay_model.selectors.drelay.global_read as gr
    from drelay_model.selectors.base import SelectionContext
    from pipelines.common.methods import load_method, load_target_spec, resolve_method

    fused = gr.fused_null_attention

    def reference(q, k, v, *, bias=None, key_mask=None):  # the same call, through the unfused reference
        return gr.null_attention(q, k, v, bias=None if bias is None else bias.transpose(-1, -2), key_mask=key_mask)

    def use(fn) -> None:  # what `null_read` calls at inference (Global Read and the history read)
        gr.fused_null_attention = fn

    target = load_target_spec("smollm2-135m")
    drafter, selector = load_method(resolve_method("drelay", target_spec="smollm2-135m"), target)
    ids = torch.randint(0, target.vocab_size, (1, 200), generator=torch.Generator().manual_seed(0))
    cache = target.new_cache(1, 256)
    times = {"reference": {"read": [], "select": []}, "fused": {"read": [], "select": []}}
    with torch.inference_mode():
        res = target(ids, cache, feature_layers=drafter.config.target_layer_ids)
        ctx = drafter.new_context_cache(1, 256)
        drafter.extend_context(res.features, ctx)
        block = drafter.draft(ids[:, -1], ctx)
        N = selector.capabilities.history_len
        sctx = SelectionContext(anchor_ids=ids[:, -1], anchor_pos=ctx.lengths.clone(), row_ids=torch.zeros(1, dtype=torch.long),
                                history=res.features[:, -N:], history_mask=torch.ones(1, N, dtype=torch.bool))  # fmt: skip
        read = selector.global_read
        H, K, nh = block.cand_ids.shape[1], block.cand_ids.shape[2], read.heads
        dg = read.read_out.in_features // nh
        g = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(1, nh, H * K, dg, generator=g) for _ in range(3))
        paths = {}
        for rep in range(args.reps + 2):  # two warm-up rounds
            for name, fn in (("reference", reference), ("fused", fused)):
                use(fn)
                t0 = time.perf_counter()
                read.attend(q, k, v, block.cand_logq, None)
                t1 = time.perf_counter()
                paths[name] = selector.select(block, sctx).path_ids
                t2 = time.perf_counter()
                if rep >= 2:
                    times[name]["read"].append(1e3 * (t1 - t0))
                    times[name]["select"].append(1e3 * (t2 - t1))
        use(fused)
    if not torch.equal(paths["reference"], paths["fused"]):
        print("error: the fused path chose a different path", file=sys.stderr)
        return 1
    print(f"bundled DRelay selector, H={H} K={K} heads={nh}, {args.threads} threads, {args.reps} alternating reps (median ms)")
    for phase in ("read", "select"):
        ref, fus = (statistics.median(times[n][phase]) for n in ("reference", "fused"))
        label = "candidate read (attention)" if phase == "read" else "whole select phase"
        print(f"  {label:<28} reference {ref:6.2f}   fused {fus:6.2f}   ÷ {ref / fus:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main, "bench_attention"))
