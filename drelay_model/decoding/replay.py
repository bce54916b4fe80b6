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

`on_round` (optional) receives a `ReplayRound` per round — pool, served path, reference tokens — for
offline diagnostics (`drelay_model.diagnostics`); it observes only and never changes the result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from drelay_model.decoding.history import history_window
from drelay_model.decoding.stats import DecodeStats
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
) -> DecodeStats:
    """Replay greedy speculative decoding over cached greedy continuations.

    Args:
        prompts        tokenized prompts.
        continuations  the target's greedy continuation of each prompt (as real decoding returns it:
                       first token from prefill, truncated at EOS or the token budget).
        selector       the selector under test (default: native); ignored when `oracle`.
        on_round       optional trace hook, called once per replayed round (observes only).
    Returns:
        DecodeStats with τ, the acceptance histogram and round counts (no timings).
    """
    selector = (selector if selector is not None else NativeSelector()).eval()
    stats = DecodeStats(num_slots=drafter.config.num_slots)
    for row, (prompt, cont) in enumerate(zip(prompts, continuations)):
        _replay_row(target, drafter, selector, prompt, cont, row, oracle, stats, on_round)
    return stats


def _replay_row(
    target, drafter, selector, prompt, cont, row: int, oracle: bool, stats: DecodeStats, on_round: RoundHook | None = None
) -> None:
    dev = target.device
    seq = torch.tensor(prompt + cont, device=dev)[None]  # [1, N]
    N, P = seq.shape[1], len(prompt)
    cache = target.new_cache(1, N)
    feats = target(seq, cache, feature_layers=drafter.config.target_layer_ids, logits_at=torch.tensor([[N - 1]], device=dev)).features
    ctx_kv = drafter.context_kv(feats, torch.arange(N, device=dev)[None])  # per layer [1, n_kv, N, hd]
    H = drafter.config.num_slots
    a, left = P, len(cont) - 1  # anchor = first generated token (from prefill); tokens left to commit
    while left > 0:
        block = draft_at(drafter, seq[:, a], a, ctx_kv)
        ref = seq[0, a + 1 : a + 1 + H]  # the target's tokens after the anchor, [≤ H]
        if oracle:
            path = oracle_path(block, ref)
        else:
            hist = hmask = None
            if selector.capabilities.history_len:
                hist, hmask = history_window(feats, a, selector.capabilities.history_len)
            sctx = SelectionContext(
                anchor_ids=seq[:, a], anchor_pos=torch.tensor([a], device=dev), row_ids=torch.tensor([row], device=dev), history=hist, history_mask=hmask
            )
            sel = selector.select(block, sctx)
            path = sel.path_ids[0, : int(sel.length[0])]
        G = min(len(path), len(ref))
        match = (path[:G] == ref[:G]).long()
        n = int(match.cumprod(0).sum())
        committed = min(n + 1, left)
        stats.record_round([n], [committed])
        stats.steps += 1
        if on_round is not None:
            on_round(ReplayRound(row=row, anchor_pos=a, block=block, path=path, ref=ref, accepted=n, committed=committed))
        a += n + 1
        left -= committed
    stats.generated += len(cont)


def draft_at(drafter: BlockDrafter, anchor_id: torch.Tensor, a: int, ctx_kv) -> DraftBlock:
    """The drafted block at anchor position `a` from full-sequence context keys/values (sees p < a)."""
    hidden = drafter.block_hidden(anchor_id.view(1, 1), torch.tensor([[a]], device=anchor_id.device), ctx_kv)[:, 0, 1:]  # [1, H, D]
    return drafter.pool(hidden)


def oracle_path(block: DraftBlock, ref: torch.Tensor) -> torch.Tensor:
    """Per slot: the reference token if the pool holds it, else the native candidate. → [H] int64."""
    cand = block.cand_ids[0]  # [H, K]
    path = cand[:, 0].clone()
    G = len(ref)
    hit = (cand[:G] == ref[:, None]).any(dim=1)  # [G]
    path[:G] = torch.where(hit, ref, path[:G])
    return path
