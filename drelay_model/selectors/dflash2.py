"""`dflash2`: DFlash-2's pairwise candidate selector — a unary score plus a low-rank predecessor ×
successor codebook term conditioned on the slot's hidden state, over a lattice whose slot 0 has the
verified anchor as predecessor, walked greedily.

Codes through the frozen embedding E (so any token, in the pool or not, has one):
    φ(a) = W_p E(a),  ψ(b) = W_s E(b)  ∈ R^r          predecessor / successor codebooks
    γ_i  = W_g h_i                     ∈ R^r          slot conditioning (zero-initialised)
    u_ib = log q_ib + ⟨W_u h_i, ψ(b)⟩ / √r            unary score (W_u zero-initialised)
    L_i(a, b) = u_ib + Σ_r φ(a)_r γ_ir ψ(b)_r / √r     lattice edge a (slot i−1, or the anchor) → b (slot i)
Lattice: slot 0's only predecessor is the anchor x_{−1}; slot i ≥ 1 has the K pool entries of slot
i−1. Greedy walk: x_i = argmax_b L_i(x_{i−1}, b), x_{−1} = anchor.  Scores [B, H, K, K] (row 0 of
slot 0 is the anchor's).

Training: teacher-forced predecessors (the anchor, then the target's labels y_{i−1}, any id) and the
pool cross-entropy −log softmax_b L_i(y_{i−1}, b)[k_i] where y_i is in the pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from drelay_model.drafter.model import DraftBlock
from drelay_model.selectors.base import Selection, SelectionContext, SelectorCapabilities, SelectorTrainInputs, SelectorTrainLoss
from drelay_model.selectors.heads import HeadConfig, PoolHead, PoolTargets, choice_metrics, pool_nll, positive_int, zero_init


@dataclass(frozen=True)
class DFlash2Config(HeadConfig):
    """rank: r, the width of the predecessor/successor codebooks."""

    selector_name = "dflash2"
    rank: int = 64

    def checks(self) -> dict[str, bool]:
        return {"rank": positive_int(self.rank)}


class DFlash2Selector(PoolHead):
    capabilities = SelectorCapabilities(trainable=True, needs_hidden=True, supports_sampling=True)
    config_cls = DFlash2Config

    def __init__(self, config: DFlash2Config, **sizes):
        super().__init__(config, **sizes)
        D, E, r = self.hidden_size, self.embed_weight.shape[1], config.rank
        self.pred_code = nn.Linear(E, r, bias=False)  # W_p
        self.succ_code = nn.Linear(E, r, bias=False)  # W_s
        self.slot_gate = zero_init(nn.Linear(D, r))  # W_g
        self.unary = zero_init(nn.Linear(D, r, bias=False))  # W_u
        self.scale = 1.0 / math.sqrt(r)

    def edge_scores(self, block: DraftBlock, pred_ids: torch.Tensor) -> torch.Tensor:
        """L_i(a, b) for predecessors pred_ids [B, H, A] (token ids of slot i's A predecessors) and
        every pool entry b of slot i → [B, H, A, K] float32."""
        h = block.hidden.to(self.dtype)  # [B, H, D]
        psi = self.succ_code(self.embed(block.cand_ids))  # [B, H, K, r]
        unary = block.cand_logq.float() + (torch.einsum("bhr,bhkr->bhk", self.unary(h), psi) * self.scale).float()
        phi = self.pred_code(self.embed(pred_ids)) * self.slot_gate(h)[:, :, None]  # [B, H, A, r] φ(a) ⊙ γ_i
        pair = torch.einsum("bhar,bhkr->bhak", phi, psi) * self.scale
        return unary[:, :, None, :] + pair.float()

    def lattice(self, block: DraftBlock, anchor_ids: torch.Tensor) -> torch.Tensor:
        """The whole lattice [B, H, K, K]: slot i ≥ 1 from each of slot i−1's K entries; slot 0 from the
        anchor (its K rows are equal)."""
        B, H, K = block.cand_ids.shape
        prev = torch.cat([anchor_ids[:, None, None].expand(B, 1, K), block.cand_ids[:, :-1]], dim=1)  # [B, H, K]
        return self.edge_scores(block, prev)

    @torch.inference_mode()
    def select(self, block: DraftBlock, ctx: SelectionContext) -> Selection:
        B, H, K = self.check_block(block)
        lat = self.lattice(block, ctx.anchor_ids)  # [B, H, K, K]
        pick = torch.zeros(B, H, dtype=torch.long, device=block.cand_ids.device)
        pick[:, 0] = lat[:, 0, 0].argmax(dim=-1)  # the anchor → slot 0
        for i in range(1, H):  # greedy walk: the best edge out of the chosen predecessor
            pick[:, i] = lat[:, i].gather(1, pick[:, i - 1, None, None].expand(B, 1, K))[:, 0].argmax(dim=-1)
        return self.gather(block, pick)

    def training_loss(self, inputs: SelectorTrainInputs) -> SelectorTrainLoss:
        block, labels, valid = inputs.block, inputs.labels, inputs.valid
        self.check_block(block)
        prev = torch.cat([inputs.anchor_ids[:, None], labels[:, :-1]], dim=1)  # [B, H] teacher-forced predecessors
        scores = self.edge_scores(block, prev[:, :, None])[:, :, 0]  # [B, H, K]
        per_token = pool_nll(scores, PoolTargets.of(block.cand_ids, labels, valid))
        return SelectorTrainLoss(weighted_sum=per_token.sum(), metrics=choice_metrics(scores, block.cand_ids, labels, valid))
