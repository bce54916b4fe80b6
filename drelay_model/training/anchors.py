"""Training math for the block drafter (pure PyTorch; the loop, Ray and MLflow live in pipelines/).

A training sequence is prompt + the target's own greedy response, so every response token is the
target's greedy label. A block anchored at position a (a response token whose successor is also a
response token — exactly the states greedy decoding visits) predicts tokens a+1 … a+H from target
features at positions < a. Many blocks per sequence run in one drafter pass (`block_hidden` masks
each block to its own context).

Anchors mix uniform samples with boundaries traced by a no-gradient **scout** (DRelay §5): starting
from a response position, run native selection under the teacher prefix, accept the leading matches
A, and advance by A + 1 — the anchors the current drafter would actually reach when decoding.

Shapes: B sequences, N positions, M anchors per sequence, H slots, V (draft) vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from drelay_model.decoding.verify import accepted_prefix
from drelay_model.drafter.model import BlockDrafter, DraftBlock


@dataclass(frozen=True)
class Blocks:
    """Anchors and their labels.

    anchors  [B, M] int64 anchor positions (padding anchors point at 0 and are invalid)
    labels   [B, M, H] int64 target tokens at a+1 … a+H (0 where invalid)
    valid    [B, M, H] bool: slot i counts iff a+1 … a+i are all response positions (contiguous)
    """

    anchors: torch.Tensor
    labels: torch.Tensor
    valid: torch.Tensor


def eligible_anchors(loss_mask: torch.Tensor) -> torch.Tensor:
    """[B, N] bool response mask → [B, N] bool: positions a with a and a+1 both response tokens."""
    ok = torch.zeros_like(loss_mask)
    ok[:, :-1] = loss_mask[:, :-1] & loss_mask[:, 1:]
    return ok


def make_blocks(
    label_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, anchor_ok: torch.Tensor, H: int
) -> Blocks:
    """Labels and validity for anchors [B, M] (anchor_ok [B, M] marks real ones)."""
    B, N = label_ids.shape
    offs = torch.arange(1, H + 1, device=anchors.device)
    pos = anchors[:, :, None] + offs  # [B, M, H]
    inside = pos < N
    pos_c = pos.clamp(max=N - 1)
    labels = torch.gather(label_ids[:, None, :].expand(-1, anchors.shape[1], -1), 2, pos_c)
    resp = torch.gather(loss_mask[:, None, :].expand(-1, anchors.shape[1], -1), 2, pos_c) & inside
    valid = resp.long().cumprod(dim=2).bool() & anchor_ok[:, :, None]  # contiguous response run
    return Blocks(anchors=anchors, labels=torch.where(valid, labels, 0), valid=valid)


def sample_uniform_anchors(eligible: torch.Tensor, m: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to m distinct eligible positions per row, uniformly. → (anchors [B, m], ok [B, m])."""
    B, N = eligible.shape
    # Drawn on the generator's device (the CPU in training), so anchors do not depend on where the batch lives.
    noise = torch.rand(B, N, generator=generator, device=generator.device).to(eligible.device)
    scores = noise + eligible.float() * 2.0  # eligible first, random order
    top = scores.topk(min(m, N), dim=1).indices
    ok = torch.gather(eligible, 1, top)
    if top.shape[1] < m:
        pad = m - top.shape[1]
        top = F.pad(top, (0, pad))
        ok = F.pad(ok, (0, pad))
    return torch.where(ok, top, 0), ok


# A teacher-forced path policy for the scout: (block over B rows, anchor ids [B], anchor positions [B],
# teacher labels [B, H]) → the path [B, H] (target ids) that incremental selection would propose.
PathPolicy = Callable[[DraftBlock, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def native_path(block: DraftBlock, anchor_ids: torch.Tensor, anchor_pos: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The native (DFlash) path: pool candidate 0, the drafter's argmax per slot. → [B, H]."""
    return block.cand_ids[:, :, 0]


@torch.no_grad()
def scout_anchors(
    drafter: BlockDrafter,
    ctx_kv,
    input_ids: torch.Tensor,
    label_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    m: int,
    generator: torch.Generator,
    *,
    policy: PathPolicy | None = None,
    restart: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Trace m decoding boundaries per row under teacher prefixes (DRelay §5, "Learn at boundaries
    the current drafter reaches").

    Each row starts at a uniformly random eligible position a; a block at a proposes a path (the
    native argmax per slot, or `policy`'s teacher-forced selection); A = leading matches with the
    teacher tokens; the next boundary is a + A + 1. Before its first failure a teacher-forced path
    sees exactly the prefix incremental selection would see, so these are the boundaries decoding
    reaches. Rows advance in lock-step, one batched no-grad block per step.

    restart  when a row's chain leaves the response, start a fresh chain at a new uniform position,
             so every row yields m scout anchors (as long as it has any eligible position) and the
             realised native-anchor fraction follows the schedule; False: one chain per row (the
             row yields fewer anchors once its chain runs off the end).
    Returns (anchors [B, m], ok [B, m]).
    """
    B, N = input_ids.shape
    H = drafter.config.num_slots
    eligible = eligible_anchors(loss_mask)
    start, has = sample_uniform_anchors(eligible, 1, generator)
    a = start[:, 0].clone()
    alive = has[:, 0].clone()
    anchors = torch.zeros(B, m, dtype=torch.long, device=input_ids.device)
    ok = torch.zeros(B, m, dtype=torch.bool, device=input_ids.device)
    for step in range(m):
        alive &= torch.gather(eligible, 1, a[:, None].clamp(max=N - 1))[:, 0]
        if restart and not bool(alive.all()):
            fresh, fresh_ok = sample_uniform_anchors(eligible, 1, generator)
            a = torch.where(alive, a, fresh[:, 0])
            alive = alive | fresh_ok[:, 0]
        if not bool(alive.any()):
            break
        anchors[:, step] = torch.where(alive, a, 0)
        ok[:, step] = alive
        anchor_ids = torch.gather(input_ids, 1, a[:, None])  # [B, 1]
        hidden = drafter.block_hidden(anchor_ids, a[:, None], ctx_kv)  # [B, 1, S, D]
        blocks = make_blocks(label_ids, loss_mask, a[:, None], alive[:, None], H)
        if policy is None:
            path = drafter.to_target_ids(drafter.logits(hidden[:, 0, 1:]).argmax(-1))  # [B, H]
        else:
            path = policy(drafter.pool(hidden[:, 0, 1:]), anchor_ids[:, 0], a, blocks.labels[:, 0])
        match = (path == blocks.labels[:, 0]) & blocks.valid[:, 0]
        accepted = accepted_prefix(match)  # [B]
        a = (a + accepted + 1).clamp(max=N - 1)
    return anchors, ok
