"""`dcoco`: parallel pairwise transition scores between adjacent slots, then prefix-first selection
(DCOCO, "Contextual Correction of Parallel Drafts", Fig. 2).

Candidate state (one per pool entry, from the slot's hidden state h_p and the candidate's frozen
embedding E(v_pk)):
    c_pk = LN(W_h h_p + W_e E(v_pk) + w_q · max(log q_pk, −30))                        [B, H, K, d]
Transition from candidate a at slot p to candidate b at slot p+1, all (p, a, b) in parallel through
one shared scorer over candidate and pair features, plus the "pair state" channel s_p = W_s h_p (the
predecessor slot's own state):
    u_p(a, b) = GELU(A c_pa + B c_{p+1,b} + C (c_pa ⊙ c_{p+1,b}) + s_p)                  [B, H−1, K, K, m]
    S_p(a, b) = log q_{p+1,b} + Δ_p(a, b),   Δ_p(a, b) = wᵀ u_p(a, b)  (w zero-initialised)
Selection (prefix-first): slot 0 keeps the draft argmax (candidate 0); then, for p = 0 … H−2,
    k_{p+1} = argmax_b S_p(k_p, b)
i.e. each slot follows the best transition from the predecessor actually chosen.

Training (transition cross-entropy, teacher-forced): for each p whose label y_p sits in the pool at
index k_p and whose successor's label y_{p+1} sits at k_{p+1},
    ℓ_{p+1} = −log softmax_b S_p(k_p, b)[k_{p+1}]
(slot 0 has no transition and no loss; pairs with a pool miss contribute nothing). Only the K
successors of the gold predecessor are scored in training: [B, H−1, K, m], not K × K.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from drelay_model.drafter.model import DraftBlock
from drelay_model.selectors.base import Selection, SelectionContext, SelectorCapabilities, SelectorTrainInputs, SelectorTrainLoss
from drelay_model.selectors.heads import HeadConfig, PoolHead, PoolTargets, choice_metrics, pool_nll, positive_int, zero_init

_LOGQ_FLOOR = -30.0


@dataclass(frozen=True)
class DCOCOConfig(HeadConfig):
    """d: candidate-state width; mlp: width of the shared transition scorer."""

    selector_name = "dcoco"
    d: int = 128
    mlp: int = 128

    def checks(self) -> dict[str, bool]:
        return {"d": positive_int(self.d), "mlp": positive_int(self.mlp)}


class DCOCOSelector(PoolHead):
    capabilities = SelectorCapabilities(trainable=True, needs_hidden=True, supports_sampling=True)
    config_cls = DCOCOConfig

    def __init__(self, config: DCOCOConfig, **sizes):
        super().__init__(config, **sizes)
        D, E, d, m = self.hidden_size, self.embed_weight.shape[1], config.d, config.mlp
        self.slot_in = nn.Linear(D, d)  # W_h
        self.cand_in = nn.Linear(E, d, bias=False)  # W_e
        self.logq_in = nn.Parameter(torch.zeros(d))  # w_q
        self.norm = nn.LayerNorm(d)
        self.pred = nn.Linear(d, m)  # A (its bias is the scorer's bias)
        self.succ = nn.Linear(d, m, bias=False)  # B
        self.pair = nn.Linear(d, m, bias=False)  # C
        self.pair_state = nn.Linear(D, m, bias=False)  # W_s
        self.out = zero_init(nn.Linear(m, 1, bias=False))  # w

    def cand_states(self, block: DraftBlock) -> torch.Tensor:
        """c_pk [B, H, K, d]."""
        logq = block.cand_logq.clamp(min=_LOGQ_FLOOR).to(self.dtype)
        s = self.slot_in(block.hidden.to(self.dtype))  # [B, H, d]
        return self.norm(s[:, :, None] + self.cand_in(self.embed(block.cand_ids)) + logq[..., None] * self.logq_in)

    def delta(self, c_prev: torch.Tensor, c_next: torch.Tensor, h_prev: torch.Tensor) -> torch.Tensor:
        """Δ for predecessor states c_prev [..., A, d] × successor states c_next [..., Bn, d], with the
        predecessor slot's hidden state h_prev [..., D] → [..., A, Bn] (the shared scorer)."""
        u = (
            self.pred(c_prev)[..., :, None, :]
            + self.succ(c_next)[..., None, :, :]
            + self.pair(c_prev[..., :, None, :] * c_next[..., None, :, :])
            + self.pair_state(h_prev.to(self.dtype))[..., None, None, :]
        )
        return self.out(F.gelu(u))[..., 0]

    def transition_scores(self, block: DraftBlock) -> torch.Tensor:
        """S_p(a, b) for every adjacent pair, in parallel: [B, H−1, K, K] float32."""
        c = self.cand_states(block)
        delta = self.delta(c[:, :-1], c[:, 1:], block.hidden[:, :-1])  # [B, H−1, K, K]
        return block.cand_logq[:, 1:, None, :].float() + delta.float()

    @torch.inference_mode()
    def select(self, block: DraftBlock, ctx: SelectionContext) -> Selection:
        B, H, K = self.check_block(block)
        scores = self.transition_scores(block)  # [B, H−1, K, K]
        pick = torch.zeros(B, H, dtype=torch.long, device=block.cand_ids.device)  # slot 0: the draft argmax
        for p in range(H - 1):  # prefix-first walk: the best transition from the chosen predecessor
            row = scores[:, p].gather(1, pick[:, p, None, None].expand(B, 1, K))[:, 0]  # [B, K]
            pick[:, p + 1] = row.argmax(dim=-1)
        return self.gather(block, pick)

    def training_loss(self, inputs: SelectorTrainInputs) -> SelectorTrainLoss:
        block, labels, valid = inputs.block, inputs.labels, inputs.valid
        B, H, K = self.check_block(block)
        t = PoolTargets.of(block.cand_ids, labels, valid)
        c = self.cand_states(block)  # [B, H, K, d]
        c_gold = c[:, :-1].gather(2, t.index[:, :-1, None, None].expand(-1, -1, 1, c.shape[-1]))  # [B, H−1, 1, d]
        delta = self.delta(c_gold, c[:, 1:], block.hidden[:, :-1])[:, :, 0]  # [B, H−1, K]
        scores = torch.cat([block.cand_logq[:, :1].float(), block.cand_logq[:, 1:].float() + delta.float()], dim=1)  # [B, H, K]
        trans = PoolTargets(
            covered=torch.cat([torch.zeros_like(t.covered[:, :1]), t.covered[:, 1:] & t.covered[:, :-1]], 1), index=t.index
        )
        per_token = pool_nll(scores, trans)
        return SelectorTrainLoss(weighted_sum=per_token.sum(), metrics=choice_metrics(scores, block.cand_ids, labels, valid))
