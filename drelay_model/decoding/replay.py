"""Greedy replay: τ without running the target in the loop.

Greedy decoding is deterministic, so once the target's greedy continuation y of a prompt is known
(decode it once and cache it), every round of speculative decoding can be replayed offline:

    one target forward over prompt + y           → context features of every position
    round at anchor position a (token seq[a]):   block from features at p < a, pool, selector path
    accepted n = leading matches of path with y  → commit min(n + 1, tokens left); a += n + 1

Because the engine is lossless, this reproduces real greedy decoding round for round (the test suite
checks that replay τ equals τ from real decoding), at the cost of the drafter and selector only.
`oracle=True` replaces the selector by one that knows y: it takes the target's token whenever the
pool holds it — the ceiling for any selector over that pool (oracle τ).

`verify_slots=L` holds the verification length fixed, as a cost-aware round that verifies L: the
selector decides the first L slots (`SelectionContext.max_slots`) and at most L drafts are checked.
`head_slots` is how many slots get drafted for it: L by default (the partial block the engine drafts
for a partial-block selector), or up to H (the whole block, which the selector reads whole while
deciding L; `analysis/partial_blocks.py` weighs the two).

`on_round` (optional) receives a `ReplayRound` per round — pool, served path, reference tokens — for
offline diagnostics (`drelay_model.diagnostics`); it observes only and never changes the result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from drelay_model.decoding.history import history_window
from drelay_model.decoding.stats import DecodeStats
from drelay_model.decoding.verify import accepted_prefix
from drelay_model.drafter.model import BlockDrafter, DraftBlock
from drelay_model.selectors.base import SelectionContext, Selector
from drelay_model.selectors.native import NativeSelector
from drelay_model.target.model import TargetModel


@dataclass(frozen=True)
class ReplayRound:
    """One replayed round, as seen by a trace hook.

    row        index of the prompt in the `replay` call.
    anchor_pos absolute position of the anchor (prompt + generated tokens before it).
    block      the drafted pool (batch of one: cand_ids [1, H, K], cand_logq [1, H, K]).
    path       [G] int64 the path submitted for verification (G ≤ H; the oracle path when `oracle`).
    ref        [R] int64 the target's tokens after the anchor (R ≤ H; shorter at the end).
    accepted   drafts accepted; committed: tokens committed (accepted + 1, cut at the end).
    """

    row: int
    anchor_pos: int
    block: DraftBlock
    path: torch.Tensor
    ref: torch.Tensor
    accepted: int
    committed: int


RoundHook = Callable[[ReplayRound], None]


@torch.inference_mode()
def replay(
    target: TargetModel,
    drafter: BlockDrafter,
    prompts: list[list[int]],
    continuations: list[list[int]],
    *,
    selector: Selector | None = None,
    oracle: bool = False,
    on_round: RoundHook | None = None,
    batch_size: int = 8,
    verify_slots: int | None = None,
    head_slots: int | None = None,
) -> DecodeStats:
    """Replay greedy speculative decoding over cached greedy continuations.

    Prompts are replayed `batch_size` at a time (sorted by length so padding stays small): one target
    forward per batch, then rounds in lockstep — each row keeps its own anchor, and rows that have
    committed their whole continuation drop out. Every row's rounds are those of replaying it alone.

    Args:
        prompts        tokenized prompts.
        continuations  the target's greedy continuation of each prompt (as real decoding returns it:
                       first token from prefill, truncated at EOS or the token budget).
        selector       the selector under test (default: native); ignored when `oracle`.
        on_round       optional trace hook, called once per replayed row-round (observes only).
        batch_size     prompts per target forward and per drafter call (≥ 1).
        verify_slots   L, drafts verified per round (default H: the whole path).
        head_slots     slots drafted per round, L ≤ head_slots ≤ H (default L).
    Returns:
        DecodeStats with τ, the acceptance histogram and round counts (no timings).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if len(prompts) != len(continuations):
        raise ValueError(f"{len(prompts)} prompts but {len(continuations)} continuations")
    H = drafter.config.num_slots
    L = H if verify_slots is None else verify_slots
    heads = L if head_slots is None else head_slots
    if not 1 <= L <= heads <= H:
        raise ValueError(f"need 1 ≤ verify_slots ≤ head_slots ≤ {H}, got verify_slots={verify_slots}, head_slots={head_slots}")
    selector = (selector if selector is not None else NativeSelector()).eval()
    stats = DecodeStats(num_slots=drafter.config.num_slots)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]) + len(continuations[i]))
    for lo in range(0, len(order), batch_size):
        rows = order[lo : lo + batch_size]
        _replay_batch(
            target,
            drafter,
            selector,
            [prompts[i] for i in rows],
            [continuations[i] for i in rows],
            rows,
            oracle,
            stats,
            on_round,
            (L, heads),
        )
    return stats


def _replay_batch(target, drafter, selector, prompts, conts, rows, oracle, stats: DecodeStats, on_round, slots) -> None:
    """Replay up to batch_size rows together (see `replay`); slots = (L verified, slots drafted)."""
    seqs = [p + c for p, c in zip(prompts, conts)]
    B, N = len(seqs), max(len(s) for s in seqs)
    device = target.device
    seq = torch.zeros(B, N, dtype=torch.long, device=device)  # right-padded: causal rows never see the pad
    for b, s in enumerate(seqs):
        seq[b, : len(s)] = torch.tensor(s, device=device)
    cache = target.new_cache(B, N)
    feats = target(
        seq, cache, feature_layers=drafter.config.target_layer_ids, logits_at=torch.zeros(B, 1, dtype=torch.long, device=device)
    ).features
    positions = torch.arange(N, device=device)[None].expand(B, -1)
    ctx_kv = drafter.context_kv(feats, positions)  # per layer [B, n_kv, N, hd]
    H = drafter.config.num_slots
    L, heads = slots
    hist_len = 0 if oracle else selector.capabilities.history_len
    anchor = [len(p) for p in prompts]  # anchor = first generated token (from prefill)
    left = [len(c) - 1 for c in conts]  # tokens left to commit per row
    while True:
        live = [b for b in range(B) if left[b] > 0]
        if not live:
            break
        idx = torch.tensor(live, device=device)
        a = torch.tensor([anchor[b] for b in live], device=device)  # [G]
        kv = [(k[idx], v[idx]) for k, v in ctx_kv]
        hidden = drafter.block_hidden(seq[idx, a][:, None], a[:, None], kv, size=1 + heads)[:, 0, 1:]  # [G, heads, D]
        block = drafter.pool(hidden)
        refs = [seq[b, anchor[b] + 1 : min(anchor[b] + 1 + L, len(seqs[b]))] for b in live]  # [≤ L] each
        if oracle:
            paths = [oracle_path(_row_block(block, g), refs[g])[:L] for g in range(len(live))]
        else:
            hist = hmask = None
            if hist_len:
                wins = [history_window(feats[b : b + 1], anchor[b], hist_len) for b in live]
                hist, hmask = torch.cat([w[0] for w in wins]), torch.cat([w[1] for w in wins])
            sctx = SelectionContext(
                anchor_ids=seq[idx, a],
                anchor_pos=a,
                row_ids=torch.tensor([rows[b] for b in live], device=device),
                history=hist,
                history_mask=hmask,
                max_slots=L if L < H else None,
            )
            sel = selector.select(block, sctx)
            lengths = sel.length.clamp(max=L).tolist()
            paths = [sel.path_ids[g, : lengths[g]] for g in range(len(live))]
        accepted, committed = [], []
        for g, b in enumerate(live):
            G = min(len(paths[g]), len(refs[g]))
            n = int(accepted_prefix(paths[g][:G] == refs[g][:G]))
            c = min(n + 1, left[b])
            accepted.append(n)
            committed.append(c)
            if on_round is not None:
                on_round(
                    ReplayRound(
                        row=rows[b],
                        anchor_pos=anchor[b],
                        block=_row_block(block, g),
                        path=paths[g],
                        ref=refs[g],
                        accepted=n,
                        committed=c,
                    )
                )
            anchor[b] += n + 1
            left[b] -= c
        stats.record_round(accepted, committed)
        stats.steps += len(live)  # one replayed round per row, as when rows are replayed alone
        stats.drafted_steps += len(live)  # replay drafts and selects every round (fixed length)
        stats.selector_steps += len(live)
    stats.generated += sum(len(c) for c in conts)


def oracle_path(block: DraftBlock, ref: torch.Tensor) -> torch.Tensor:
    """Per slot: the reference token if the pool holds it, else the native candidate. → [H] int64."""
    cand = block.cand_ids[0]  # [H, K]
    path = cand[:, 0].clone()
    G = len(ref)
    hit = (cand[:G] == ref[:, None]).any(dim=1)  # [G]
    path[:G] = torch.where(hit, ref, path[:G])
    return path


def _row_block(block: DraftBlock, g: int) -> DraftBlock:
    """Row g of a drafted block, as a batch of one."""
    return DraftBlock(hidden=block.hidden[g : g + 1], cand_ids=block.cand_ids[g : g + 1], cand_logq=block.cand_logq[g : g + 1])
