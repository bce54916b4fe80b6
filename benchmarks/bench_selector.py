"""DRelay selector overhead per round on the CPU target's dimensions (smollm2-135m).

Dims: D = 576, H = 15 slots, K = 16 candidates, F = 3·576 target features, V = 49,152.
A random drafter (DrafterConfig.for_target: 2 layers, full-vocabulary head) and a freshly built
`drelay` selector (default config: d_sel = 256, read_dim = 128, history_len = 64); batch 1, fp32, one block drafted
after a ~200-token verified context. Per repetition the three phases alternate (draft → select →
verify), so machine load hits them alike; medians are reported:
  draft        drafter.draft(anchor, ctx)                         one block + the top-K pool
  select       selector.select(block, ctx)                        Global Read + the H causal decisions
  verify       target forward over anchor + 15 drafts = 16 tokens on the cached context (cropped back)
  select %     select / (draft + select + verify), the selector's share of a round
A fresh selector keeps every native token, so its decisions settle in one parallel pass; the
"repairing" row randomises the zero-initialised residual heads (plus a gate bias; the default
gives ~4 repairs per block) so that the decisions need more passes (or the sequential fallback). Also
printed: the split into the prefix-independent part (Global Read + history read + evidence) and
the decisions (parallel passes vs the literal slot-by-slot loop), and the selector's trainable
parameter count (the frozen embedding is shared, not counted).

Run:  .venv/bin/python benchmarks/bench_selector.py                 # 1 thread (default), ~1 min
      .venv/bin/python benchmarks/bench_selector.py --checkpoint checkpoints/smollm2-135m   # trained
      .venv/bin/python benchmarks/bench_selector.py --threads 2 --reps 50
      .venv/bin/python benchmarks/bench_selector.py --checkpoint checkpoints/smollm2-135m --compile
                      # also: torch.compile of the whole select phase vs eager, paired (compile time printed)

Rounds recorded from real decoding, and the select phase by part (reference vs the CPU fast path):
      .venv/bin/python benchmarks/bench_selector.py --record outputs/selector_rounds.pt --prompts 4
                      # our engine decodes GSM8K prompts with the bundled checkpoint (batch 1, fixed
                      # length) and keeps every select call's inputs
      .venv/bin/python benchmarks/bench_selector.py --parts outputs/selector_rounds.pt --batches 1,8,16
                      # per-part table (thread CPU ms, medians; reference and fast path alternating)
      .venv/bin/python benchmarks/bench_selector.py --walks outputs/selector_rounds.pt --batches 1
                      # the walk against parallel passes and a compiled walk (benchmarks/walk_variants.py)
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
import statistics
import time

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--context", type=int, default=200, help="verified tokens before the block")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repair-bias", type=float, default=5.0, help="gate bias of the repairing selector")
    p.add_argument("--checkpoint", help="a trained drafter + DRelay selector (default: random drafter, fresh selector)")
    p.add_argument("--compile", action="store_true", help="also time torch.compile(select) against eager, paired")
    p.add_argument("--record", metavar="FILE", help="record select rounds from real decoding into FILE, then stop")
    p.add_argument("--prompts", type=int, default=4, help="GSM8K prompts decoded by --record")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per prompt decoded by --record")
    p.add_argument("--fixture", metavar="FILE", help="with --record: also write a compact fixture of a few rounds")
    p.add_argument("--parts", metavar="FILE", help="per-part table over the rounds recorded in FILE, then stop")
    p.add_argument("--batches", default="1,8,16", help="batch sizes of the --parts (and --walks) table")
    p.add_argument("--walks", metavar="FILE", help="the walk against parallel passes and a compiled walk (walk_variants.py)")
    return p.parse_args()


def timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


def setup(args):
    """Target, random drafter, fresh selector and one round's inputs after a verified context."""
    from drelay_model.decoding.history import VerifiedHistory
    from drelay_model.drafter import BlockDrafter, DrafterConfig
    from drelay_model.selectors import SelectionContext, default_registry
    from drelay_model.target import load_target

    torch.manual_seed(args.seed)
    target = load_target(args.target)
    if args.checkpoint:
        from drelay_model.drafter import load_drafter

        drafter, extra, meta = load_drafter(args.checkpoint, target)
        selector = default_registry().from_checkpoint("drelay", drafter=drafter, tensors=extra, meta=meta)
    else:
        drafter = BlockDrafter(DrafterConfig.for_target(target), target).eval()
        selector = default_registry().create("drelay", drafter=drafter).eval()
    layers = drafter.config.target_layer_ids
    prompt = torch.randint(0, target.vocab_size, (1, args.context))
    cache = target.new_cache(1, args.context + 64)
    res = target(prompt, cache, feature_layers=layers, logits_at=torch.tensor([[args.context - 1]]))
    ctx_cache = drafter.new_context_cache(1, args.context + 64)
    drafter.extend_context(res.features, ctx_cache)
    hist = VerifiedHistory(1, selector.capabilities.history_len, res.features.shape[-1])
    hist.push(res.features, torch.tensor([args.context]))
    anchor = res.logits[:, 0].argmax(-1)  # [1]
    sctx = SelectionContext(
        anchor_ids=anchor,
        anchor_pos=cache.lengths.clone(),
        row_ids=torch.tensor([0]),
        history=hist.feats,
        history_mask=hist.mask(),
    )
    return target, drafter, selector, cache, ctx_cache, anchor, sctx


def main() -> None:
    args = parse_args()
    from pipelines.common.checkpoint_refs import resolve_ref

    args.checkpoint = args.checkpoint and resolve_ref(args.checkpoint)  # FOLDER@COMMIT too
    torch.set_num_threads(args.threads)
    if args.record or args.parts or args.walks:
        return rounds_mode(args)
    with torch.no_grad():  # not inference_mode: weights made there are never packed (cpu_linear.PackCache)
        target, drafter, selector, cache, ctx_cache, anchor, sctx = setup(args)
        repairing = repairing_copy(selector, drafter, args)
    with torch.inference_mode():
        measure(args, target, drafter, selector, repairing, cache, ctx_cache, anchor, sctx)
    if args.compile:
        with torch.no_grad():  # inference tensors cannot enter a compiled graph's guards as parameters
            compiled_select(args, drafter, selector, ctx_cache, anchor, sctx)


def rounds_mode(args) -> None:
    """--record: rounds from real decoding into a file; --parts: the per-part table over them."""
    import selector_rounds as sr

    from drelay_model.target import load_target

    target = load_target(args.target)
    checkpoint = args.checkpoint or "checkpoints/smollm2-135m"
    if args.record:
        from pipelines.data.eval_sets import first_turn_prompts

        prompts = first_turn_prompts(target.tokenizer, "gsm8k", args.prompts)
        rounds = sr.record_rounds(target, checkpoint, prompts, args.max_new_tokens)
        Path(args.record).parent.mkdir(parents=True, exist_ok=True)
        torch.save(rounds, args.record)
        print(f"{len(rounds)} rounds from {args.prompts} GSM8K prompts → {args.record}")
        if args.fixture:
            sr.write_fixture(rounds, Path(args.fixture), count=6)
            print(f"fixture: 6 rounds → {args.fixture}")
        return
    from drelay_model.drafter import load_drafter
    from drelay_model.selectors import default_registry

    with torch.no_grad():  # not inference_mode: weights made there are never packed (cpu_linear.PackCache)
        drafter, extra, meta = load_drafter(checkpoint, target)
        selector = default_registry().from_checkpoint("drelay", drafter=drafter, tensors=extra, meta=meta).eval()
    if args.walks:
        from walk_variants import compare_walks

        rounds = torch.load(args.walks)
        for b in (int(x) for x in args.batches.split(",")):
            compare_walks(selector, sr.batches(rounds, b), reps=max(args.reps // 10, 1))
        return
    rounds = torch.load(args.parts)
    print(f"{len(rounds)} recorded rounds ({args.parts}); {checkpoint}; torch threads={args.threads}, reps={args.reps}")
    print("thread CPU ms per round (medians); reference | fast path")
    for b in (int(x) for x in args.batches.split(",")):
        ms = sr.time_parts(selector, sr.batches(rounds, b)[:8], reps=args.reps)
        print(f"batch {b}\n| part | reference | fast path | fast ÷ reference |\n|---|---|---|---|")
        for part in sr.PARTS:
            ref, fast = ms["reference"][part], ms["fast"][part]
            print(f"| {part} | {ref:.2f} | {fast:.2f} | {fast / ref:.2f} |", flush=True)


def compiled_select(args, drafter, selector, ctx_cache, anchor, sctx) -> None:
    """Inductor on the whole select phase (Global Read, history read, the walk), eager and compiled
    alternating per repetition; checks that both pick the same path."""
    eager = type(selector).select_with_scores.__wrapped__  # the body, without its inference_mode wrapper
    block = drafter.draft(anchor, ctx_cache)
    compiled = torch.compile(lambda blk, ctx: eager(selector, blk, ctx), dynamic=False)
    t0 = time.perf_counter()
    out_c = compiled(block, sctx)
    t_compile = time.perf_counter() - t0
    out_e = eager(selector, block, sctx)
    same = torch.equal(out_c.selection.pool_index, out_e.selection.pool_index)
    te, tc = [], []
    for _ in range(args.reps):
        te.append(timed(eager, selector, block, sctx)[1] * 1e3)
        tc.append(timed(compiled, block, sctx)[1] * 1e3)
    print(
        f"  torch.compile(select): first call {t_compile:.1f} s; eager {statistics.median(te):.2f} ms, "
        f"compiled {statistics.median(tc):.2f} ms (compiled ÷ eager {statistics.median(tc) / statistics.median(te):.2f}); "
        f"same path: {same}"
    )


def repairing_copy(selector, drafter, args):
    """The same selector (same config and weights) with randomised residual heads and a gate bias
    towards REPAIR, so that its decisions repair often."""
    repairing = type(selector).build(drafter=drafter, config=selector.config.to_dict()).eval()
    repairing.load_state_dict(selector.state_dict())
    g = torch.Generator().manual_seed(args.seed)
    for p in repairing.residual_heads():
        p.copy_(torch.randn(p.shape, generator=g))
    repairing.causal.head.bias[1] += args.repair_bias  # push the gate towards REPAIR
    return repairing


def measure(args, target, drafter, selector, repairing, cache, ctx_cache, anchor, sctx) -> None:
    layers = drafter.config.target_layer_ids
    start = cache.lengths.clone()
    t = {k: [] for k in ("draft", "select", "select_repairing", "evidence", "decide", "loop", "verify", "select_p2")}
    sctx_p2 = dataclasses.replace(sctx, max_slots=2)  # cost-aware length planned 2 drafts: 2 decisions
    repairs = trained_repairs = 0
    for rep in range(args.reps + 3):  # 3 warm-up repetitions
        block, t_draft = timed(drafter.draft, anchor, ctx_cache)
        sel, t_select = timed(selector.select, block, sctx)
        sel_r, t_select_r = timed(repairing.select, block, sctx)
        _, t_select_p2 = timed(selector.select, block, sctx_p2)
        (ev, cand_emb), t_ev = timed(selector.evidence, block, sctx.history, sctx.history_mask)
        _, t_decide = timed(repairing.causal.decide_block, ev, selector.embed(anchor), cand_emb)
        _, t_loop = timed(repairing.causal.sequential, ev, selector.embed(anchor), cand_emb)
        ids = torch.cat([anchor[:, None], sel.path_ids], dim=1)  # [1, 16]
        _, t_verify = timed(lambda: target(ids, cache, feature_layers=layers))
        cache.crop(start)
        if rep >= 3:
            for k, v in zip(t, (t_draft, t_select, t_select_r, t_ev, t_decide, t_loop, t_verify, t_select_p2)):
                t[k].append(v * 1e3)
            repairs += int((sel_r.pool_index != 0).sum())
            trained_repairs += int((sel.pool_index != 0).sum())
            assert args.checkpoint or trained_repairs == 0  # a fresh selector is exactly native
    med = {k: statistics.median(v) for k, v in t.items()}
    round_ms = med["draft"] + med["select"] + med["verify"]
    n_params = sum(p.numel() for p in selector.parameters())
    cfg = drafter.config
    print(
        f"target {args.target}: D={cfg.hidden_size} H={cfg.num_slots} K={cfg.top_k} "
        f"F={len(cfg.target_layer_ids) * cfg.hidden_size} V={target.vocab_size}; "
        f"torch threads={args.threads}, reps={args.reps}, context={args.context}"
    )
    print(f"selector: drelay {selector.config.to_dict()}")
    print(f"selector parameters: {n_params:,} trainable ({n_params / 1e6:.2f}M; frozen embedding shared, not counted)")
    print(f"  draft            {med['draft']:7.2f} ms")
    if args.checkpoint:
        print(
            f"  select           {med['select']:7.2f} ms   trained selector of {args.checkpoint}, {trained_repairs / args.reps:.1f} repairs per block"
        )
    else:
        print(f"  select           {med['select']:7.2f} ms   fresh selector (keeps every native token: one pass)")
    print(f"  select, 2 slots  {med['select_p2']:7.2f} ms   SelectionContext.max_slots=2 (cost-aware length planned 2 drafts)")
    print(
        f"  select repairing {med['select_repairing']:7.2f} ms   randomised residual heads, {repairs / args.reps:.1f} repairs per block"
    )
    print(f"    of which       {med['evidence']:7.2f} ms   Global Read + prefix-independent evidence (once per block)")
    print(f"                   {med['decide']:7.2f} ms   decisions by parallel passes (decide_block, repairing)")
    print(f"                   {med['loop']:7.2f} ms   the same decisions slot by slot (sequential, for reference)")
    print(f"  verify (16 tok)  {med['verify']:7.2f} ms")
    print(f"  round            {round_ms:7.2f} ms   select = {100 * med['select'] / round_ms:.1f}% of a round")


if __name__ == "__main__":
    from cli import guarded

    raise SystemExit(guarded(main, Path(__file__).name))
