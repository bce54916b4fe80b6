"""Step `accepted`: accepted drafts, cache crops and commits on the device, checked lossless.

An untrained drafter accepts almost nothing (τ ≈ 1), so the `lossless` step exercises rejection and
the bonus token only. Here a scripted selector proposes the target's own greedy continuation (read
from an AR run of the same target) for the first j slots of a round and a wrong token at slot j, with
j cycling through 0..H per row (a different phase per row): every accept length 0..H occurs, rows
of one batch accept different lengths in the same round, and every round crops the target's cache
by H − j rejected entries per row. The target is random with Qwen3-4B's shapes (vocabulary 151,936,
width 2,560, 32/8 heads × 128) and fewer layers; one untrained drafter layer drafts each round (its
pool is ignored). Checks, per dtype:

    float32   accepted[b] = the scheduled j in every round; tokens = the AR engine's, token for token;
              after every round the cache holds start + 1 + accepted positions per row; at the end the
              target's and the drafter's cached keys/values equal a fresh prefill of each row's
              committed sequence (relative max difference ≤ KV_RTOL).
    bfloat16  verify(16) and decode(1) round differently, so the AR reference may disagree with a
              verify's argmax: tokens are checked as the bf16 target's argmax up to ties, lengths
              after every round as in fp32; how many rounds accepted as scheduled is reported.
"""

from __future__ import annotations

import torch

from benchmarks.gpu.check_lossless import _argmax_up_to_ties
from benchmarks.gpu.common import QWEN3_4B, QWEN3_TINY, random_qwen3_target
from drelay_model.decoding import GenerationConfig, SpeculativeEngine
from drelay_model.decoding.stats import DecodeStats
from drelay_model.decoding.verify import accept
from drelay_model.drafter import BlockDrafter, DrafterConfig
from drelay_model.selectors import Selection, SelectionContext, Selector

DESCRIPTION = "accepted drafts: a scripted selector accepts 0..H per round on a Qwen3-4B-shaped target; lossless, crops, commits"
NEEDS = ("cuda",)
KV_RTOL = 1e-3  # fp32: a decoded cache vs a fresh prefill of the same tokens (different batching only)
SHAPES = {
    "full": dict(target=QWEN3_4B, layers=8, prompts=(37, 120, 5, 64)),
    "tiny": dict(target=QWEN3_TINY, layers=2, prompts=(7, 12)),
}


class ScheduledSelector(Selector):
    """Proposes reference[row][p+1 : p+1+j] then a wrong token at slot j (anchor at position p), with
    j = (calls of that row + phase[row]) mod (H + 1): the target accepts exactly j drafts whenever
    the reference is the target's own continuation. Ignores the pool; one host copy per round."""

    def __init__(self, reference: list[list[int]], vocab: int) -> None:
        super().__init__()
        self.reference, self.vocab = reference, vocab
        self.calls = [0] * len(reference)
        self.scheduled: list[list[int]] = []  # per round: j of each live row, in batch order

    def select(self, block, ctx: SelectionContext) -> Selection:
        B, H, _ = block.cand_ids.shape
        paths, js = [], []
        for row, p in zip(ctx.row_ids.tolist(), ctx.anchor_pos.tolist()):
            j = (self.calls[row] + 5 * row) % (H + 1)
            self.calls[row] += 1
            ref = self.reference[row][p + 1 : p + 1 + H]
            ref = ref + [0] * (H - len(ref))
            paths.append([t if i < j else (t + 1) % self.vocab for i, t in enumerate(ref)])
            js.append(j)
        self.scheduled.append(js)
        dev = block.cand_ids.device
        path = torch.tensor(paths, dtype=torch.long, device=dev)  # [B, H]
        return Selection(
            pool_index=torch.zeros(B, H, dtype=torch.long, device=dev),
            path_ids=path,
            length=torch.full((B,), H, dtype=torch.long, device=dev),
        )


def _greedy(path, logits, length, proposal=None):
    return accept(path, logits, length, temperature=0.0, draws=None)


@torch.inference_mode()
def _decode(engine: SpeculativeEngine, prompts: list[list[int]], rounds: int, capacity: int) -> dict:
    """`rounds` engine rounds over the whole batch (no row leaves) → tokens, accepted per round, and
    whether every round left start + 1 + accepted positions in the target's cache."""
    state, last = engine.prefill(prompts, list(range(len(prompts))), capacity)
    state.anchor = last.argmax(dim=-1)
    out = [[t] for t in state.anchor.tolist()]
    stats = DecodeStats(num_slots=engine.num_slots, requests=len(prompts))
    accepted, lengths_ok = [], True
    for _ in range(rounds):
        start = state.cache.lengths.clone()
        res = engine.round(state, _greedy, stats)
        lengths_ok &= bool(torch.equal(state.cache.lengths, start + 1 + res.accepted))
        n, x, p = res.accepted.tolist(), res.next_token.tolist(), res.path.tolist()
        for b in range(len(prompts)):
            out[b] += p[b][: n[b]] + [x[b]]
        stats.record_round(n, [k + 1 for k in n], [engine.num_slots] * len(n))
        accepted.append(n)
    state.sync_context(engine.drafter)  # the drafter's context catches up with the last round
    return {"tokens": out, "accepted": accepted, "lengths_ok": lengths_ok, "state": state, "stats": stats}


@torch.inference_mode()
def _kv_rel_diff(engine: SpeculativeEngine, prompts: list[list[int]], run: dict, capacity: int) -> float:
    """Largest relative difference between each row's decoded caches (target and drafter context)
    and a fresh prefill of that row's committed sequence (prompt + tokens but the uncached anchor)."""
    state, worst = run["state"], 0.0
    for b, prompt in enumerate(prompts):
        seq = prompt + run["tokens"][b][:-1]
        fresh, _ = engine.prefill([seq], [0], capacity)
        L = len(seq)
        if int(state.cache.lengths[b]) != L or int(state.ctx.lengths[b]) != L:
            return float("inf")
        for got, ref in ((state.cache.k, fresh.cache.k), (state.cache.v, fresh.cache.v), (state.ctx.k, fresh.ctx.k)):
            a, r = got[:, b, :, :L].float(), ref[:, 0, :, :L].float()
            worst = max(worst, float((a - r).abs().max() / r.abs().max().clamp_min(1e-6)))
    return worst


def run(device: str, scale: str) -> dict:
    s = SHAPES[scale]
    report: dict = {"target": f"random Qwen3 {s['target']['hidden_size']} wide, {s['layers']} layers", "dtypes": {}}
    ok = True
    for dtype in (torch.float32, torch.bfloat16):
        target = random_qwen3_target(s["target"], layers=s["layers"], device=device, dtype=dtype)
        torch.manual_seed(0)
        drafter = BlockDrafter(DrafterConfig.for_target(target, num_layers=1), target).to(device=device, dtype=dtype)
        H = drafter.config.num_slots
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, target.vocab_size, (n,), generator=g).tolist() for n in s["prompts"]]
        rounds = H + 1  # each row meets every j in 0..H once: at most (H + 1)(H + 2) / 2 tokens
        n_ref = 1 + rounds * (H + 1) + H + 1
        cfg = GenerationConfig(max_new_tokens=n_ref, stop_on_eos=False)
        ar = SpeculativeEngine(target).generate(prompts, cfg).tokens
        selector = ScheduledSelector([p + a for p, a in zip(prompts, ar)], target.vocab_size)
        engine = SpeculativeEngine(target, drafter, selector)
        capacity = max(s["prompts"]) + n_ref + H + 2
        res = _decode(engine, prompts, rounds, capacity)
        as_scheduled = sum(a == j for acc, js in zip(res["accepted"], selector.scheduled) for a, j in zip(acc, js))
        total = sum(len(a) for a in res["accepted"])
        exact = all(t == a[: len(t)] for t, a in zip(res["tokens"], ar))
        rec = {
            "rounds": rounds,
            "accept_hist": res["stats"].accept_hist.tolist(),
            "tau": round(res["stats"].tau, 3),
            "accepted_as_scheduled": f"{as_scheduled}/{total}",
            "tokens_equal_ar": exact,
            "lengths_after_every_round": res["lengths_ok"],
        }
        if dtype == torch.float32:
            rec["kv_vs_fresh_prefill_rel"] = _kv_rel_diff(engine, prompts, res, capacity)
            rec["ok"] = exact and res["lengths_ok"] and as_scheduled == total and rec["kv_vs_fresh_prefill_rel"] <= KV_RTOL
        else:
            rec["argmax_up_to_ties"] = all(_argmax_up_to_ties(target, p, t) for p, t in zip(prompts, res["tokens"]))
            rec["ok"] = rec["argmax_up_to_ties"] and res["lengths_ok"]
        report["dtypes"][str(dtype).removeprefix("torch.")] = rec
        ok &= rec["ok"]
        del target, drafter, engine, res
    report["ok"] = ok
    return report
