"""The drafter's vocabulary head in training, chunked: support CE and the top-K pool without ever
holding full-vocabulary logits for all anchor slots at once.

For R anchor blocks × H slots and a (draft) vocabulary V, today's dense path builds logits [R, H, V]
in float32 (and a log-softmax of the same size for the pool, and another inside the CE). Here the
R·H slot states go through the head in chunks of at most `chunk_tokens` rows:

    logq_c = log_softmax(W h_c)                [r, H, V] float32, one chunk at a time
    nll_c  = −Σ_j w_j logq_c[t_j]              targets t, weights w [r, H, k] (`losses.SupportTargets`):
                                               k = 1, w = 1 at the label y (hard labels), or the
                                               target's renormalised top-k (soft labels); 0 where the
                                               slot is unsupervised / not draftable
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
from drelay_model.training.losses import SoftLabels, hard_support_targets, soft_support_targets

DEFAULT_CHUNK_TOKENS = 2048


@dataclass(frozen=True)
class HeadOutput:
    """nll [R, H] float32 −log q(y) (soft labels: −Σ_j p̃(t_j) log q(t_j)) where counted, else 0;
    counted [R, H] bool (supervised and draftable); out_of_vocab [] int64 supervised slots with nothing
    draftable; block the pool (hidden [R, H, D], cand_ids, cand_logq [R, H, K]) with gradients through
    cand_logq."""

    nll: torch.Tensor
    counted: torch.Tensor
    out_of_vocab: torch.Tensor
    block: DraftBlock


def _chunk(drafter: BlockDrafter, top_k: int, hidden: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor):
    """hidden [r, H, D], ids/weight [r, H, k] support targets → nll [r, H], cand_logq, cand [r, H, K]."""
    logq = torch.log_softmax(drafter.logits(hidden), dim=-1)  # [r, H, V] float32
    cand_logq, cand = logq.topk(top_k, dim=-1)
    nll = -(weight * logq.gather(-1, ids)).sum(dim=-1)
    return nll, cand_logq, cand


def chunked_head(
    drafter: BlockDrafter,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    soft: SoftLabels | None = None,
) -> HeadOutput:
    """Support CE and pool of R blocks. hidden [R, H, D]; labels [R, H] target ids; mask [R, H] bool;
    soft [R, H, k] the target's top-k at each slot (soft labels), or None (hard labels)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be ≥ 1, got {chunk_tokens}")
    R, H, _ = hidden.shape
    d2t = drafter.draft_to_target
    if soft is None:
        tgt = hard_support_targets(labels, mask, draft_to_target=d2t)
    else:
        tgt = soft_support_targets(soft, mask, draft_to_target=d2t)
    rows = max(1, chunk_tokens // H)
    outs = []
    for s in range(0, R, rows):
        h, ids, w = hidden[s : s + rows], tgt.ids[s : s + rows], tgt.weight[s : s + rows]
        if torch.is_grad_enabled() and h.requires_grad:
            outs.append(checkpoint(_chunk, drafter, drafter.config.top_k, h, ids, w, use_reentrant=False))
        else:
            outs.append(_chunk(drafter, drafter.config.top_k, h, ids, w))
    nll, cand_logq, cand = (torch.cat(parts) for parts in zip(*outs))
    block = DraftBlock(hidden=hidden, cand_ids=drafter.to_target_ids(cand), cand_logq=cand_logq)
    return HeadOutput(nll=nll, counted=tgt.counted, out_of_vocab=tgt.out_of_vocab, block=block)
