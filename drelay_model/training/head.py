"""The drafter's vocabulary head in training, chunked: support CE and the top-K pool without ever
holding full-vocabulary logits for all anchor slots at once.

For R anchor blocks × H slots and a (draft) vocabulary V, today's dense path builds logits [R, H, V]
in float32 (and a log-softmax of the same size for the pool, and another inside the CE). Here the
R·H slot states go through the head in chunks of at most `chunk_tokens` rows:

    logq_c = log_softmax(W h_c)                [r, H, V] float32, one chunk at a time
    nll_c  = −logq_c[y]                        (0 where the label is unsupervised / not draftable)
    pool_c = top-K(logq_c)                     cand_ids, cand_logq [r, H, K]

Each chunk runs under activation checkpointing, so the backward recomputes its logits instead of
keeping them: peak head memory is O(chunk_tokens · V), not O(R · H · V). Values and gradients equal
the dense path (`support_ce` + `BlockDrafter.pool`): the same log-softmax, gathered the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from drelay_model.drafter.model import BlockDrafter, DraftBlock

DEFAULT_CHUNK_TOKENS = 2048


@dataclass(frozen=True)
class HeadOutput:
    """nll [R, H] float32 −log q(y) where counted, else 0; counted [R, H] bool (supervised and
    draftable); out_of_vocab [] int64 supervised labels outside the draft vocabulary; block the
    pool (hidden [R, H, D], cand_ids, cand_logq [R, H, K]) with gradients through cand_logq."""

    nll: torch.Tensor
    counted: torch.Tensor
    out_of_vocab: torch.Tensor
    block: DraftBlock


def draft_labels(drafter: BlockDrafter, labels: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Target-vocabulary labels [R, H] → (draft-vocabulary targets [R, H] with −100 where not
    counted, inside [R, H] bool: the label is draftable)."""
    d2t = drafter.draft_to_target
    if d2t is None:
        draft, inside = labels, torch.ones_like(mask)
    else:
        pos = torch.searchsorted(d2t, labels).clamp(max=d2t.shape[0] - 1)
        inside = d2t[pos] == labels
        draft = pos
    return torch.where(mask & inside, draft, torch.full_like(draft, -100)), inside


def _chunk(drafter: BlockDrafter, top_k: int, hidden: torch.Tensor, target: torch.Tensor):
    """hidden [r, H, D], target [r, H] (−100 = ignore) → nll [r, H], cand_logq, cand [r, H, K]."""
    logq = torch.log_softmax(drafter.logits(hidden), dim=-1)  # [r, H, V] float32
    cand_logq, cand = logq.topk(top_k, dim=-1)
    picked = logq.gather(-1, target.clamp(min=0)[..., None])[..., 0]
    nll = torch.where(target >= 0, -picked, torch.zeros_like(picked))
    return nll, cand_logq, cand


def chunked_head(
    drafter: BlockDrafter,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> HeadOutput:
    """Support CE and pool of R blocks. hidden [R, H, D]; labels [R, H] target ids; mask [R, H] bool."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be ≥ 1, got {chunk_tokens}")
    R, H, _ = hidden.shape
    target, inside = draft_labels(drafter, labels, mask)
    rows = max(1, chunk_tokens // H)
    outs = []
    for s in range(0, R, rows):
        h, t = hidden[s : s + rows], target[s : s + rows]
        if torch.is_grad_enabled() and h.requires_grad:
            outs.append(checkpoint(_chunk, drafter, drafter.config.top_k, h, t, use_reentrant=False))
        else:
            outs.append(_chunk(drafter, drafter.config.top_k, h, t))
    nll, cand_logq, cand = (torch.cat(parts) for parts in zip(*outs))
    block = DraftBlock(hidden=hidden, cand_ids=drafter.to_target_ids(cand), cand_logq=cand_logq)
    return HeadOutput(nll=nll, counted=mask & inside, out_of_vocab=(mask & ~inside).sum(), block=block)
