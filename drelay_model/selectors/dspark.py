"""`dspark`: a preceding-token Markov head and confidence-scheduled verification length (DSpark,
"Confidence-Scheduled Speculative Decoding with Semi-Autoregressive Generation"; its default head).

Markov head: a low-rank transition conditioned on the previously selected token only,
    T(a, b) = ⟨U E(a), V E(b)⟩ / √r           U zero-initialised (a fresh head is native)
    S_i(b)  = log q_i(b) + T(x_{i−1}, b),     x_{−1} = the anchor,   x_i = argmax_{b ∈ pool_i} S_i(b)
Confidence of the chosen token: the head's distribution over the pool, scaled by the pool's mass
under q (the rest of the mass lies outside the pool and can never be served):
    p_i = softmax_k(S_ik)[k_i] · Σ_k q_ik
Verification length (the cut rule): verify the longest prefix whose cumulative confidence stays at or
above the threshold, and at least `min_length` tokens:
    n = max(min_length, #{i : Π_{j≤i} p_j ≥ threshold})     (Π is non-increasing: a leading run)
The engine verifies only path[:n]; every shorter path stays lossless (accept() ignores the rest).

Training: teacher-forced predecessors (anchor, then the labels), pool cross-entropy on S.
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
class DSparkConfig(HeadConfig):
    """rank: r of the Markov transition; threshold ∈ [0, 1): cumulative-confidence cut (0 = never cut);
    min_length ≥ 1: the fewest path tokens verified."""

    selector_name = "dspark"
    rank: int = 64
    threshold: float = 0.05
    min_length: int = 1

    def checks(self) -> dict[str, bool]:
        return {
            "rank": positive_int(self.rank),
            "threshold": isinstance(self.threshold, float) and 0.0 <= self.threshold < 1.0,
            "min_length": positive_int(self.min_length),
        }


def cut_length(conf: torch.Tensor, threshold: float, min_length: int) -> torch.Tensor:
    """The cut rule. conf [B, H] per-slot confidences p_i ∈ [0, 1] → [B] int64 lengths in [min(min_length, H), H]."""
    H = conf.shape[1]
    keep = torch.cumprod(conf.float(), dim=1) >= threshold  # [B, H], a leading run of True
    return keep.long().sum(dim=1).clamp(min=min(min_length, H))


class DSparkSelector(PoolHead):
    capabilities = SelectorCapabilities(trainable=True, needs_hidden=False, supports_sampling=True, may_shorten=True)
    config_cls = DSparkConfig

    def __init__(self, config: DSparkConfig, **sizes):
        super().__init__(config, **sizes)
        E, r = self.embed_weight.shape[1], config.rank
        self.pred_code = zero_init(nn.Linear(E, r, bias=False))  # U
        self.succ_code = nn.Linear(E, r, bias=False)  # V
        self.scale = 1.0 / math.sqrt(r)

    def scores(self, block: DraftBlock, prev_ids: torch.Tensor) -> torch.Tensor:
        """S_i(b) for predecessors prev_ids [B, H'] over the first H' slots' pools → [B, H', K] float32."""
        Hp = prev_ids.shape[1]
        succ = self.succ_code(self.embed(block.cand_ids[:, :Hp])) * self.scale  # [B, H', K, r]
        return block.cand_logq[:, :Hp].float() + torch.einsum("bhr,bhkr->bhk", self.pred_code(self.embed(prev_ids)), succ).float()

    @torch.inference_mode()
    def select(self, block: DraftBlock, ctx: SelectionContext) -> Selection:
        B, H, K = self.check_block(block)
        cand_emb = self.embed(block.cand_ids)  # [B, H, K, E]
        succ = self.succ_code(cand_emb) * self.scale  # [B, H, K, r] V E(b) / √r
        pred = self.pred_code(cand_emb)  # [B, H, K, r] U E(a) of every candidate, as a predecessor
        a = self.pred_code(self.embed(ctx.anchor_ids))  # [B, r] the anchor precedes slot 0
        mass = block.cand_logq.float().logsumexp(dim=-1).exp()  # [B, H] Σ_k q_ik
        pick = torch.zeros(B, H, dtype=torch.long, device=block.cand_ids.device)
        conf = torch.zeros(B, H, dtype=torch.float32, device=block.cand_ids.device)
        for i in range(H):  # the Markov head conditions on the token chosen just before
            s = block.cand_logq[:, i].float() + torch.einsum("br,bkr->bk", a, succ[:, i]).float()  # [B, K]
            pick[:, i] = s.argmax(dim=-1)
            conf[:, i] = s.softmax(dim=-1).gather(1, pick[:, i, None])[:, 0] * mass[:, i]
            a = pred[:, i].gather(1, pick[:, i, None, None].expand(B, 1, pred.shape[-1]))[:, 0]
        return self.gather(block, pick, cut_length(conf, self.config.threshold, self.config.min_length))

    def training_loss(self, inputs: SelectorTrainInputs) -> SelectorTrainLoss:
        block, labels, valid = inputs.block, inputs.labels, inputs.valid
        self.check_block(block)
        prev = torch.cat([inputs.anchor_ids[:, None], labels[:, :-1]], dim=1)  # [B, H]
        s = self.scores(block, prev)
        per_token = pool_nll(s, PoolTargets.of(block.cand_ids, labels, valid))
        return SelectorTrainLoss(weighted_sum=per_token.sum(), metrics=choice_metrics(s, block.cand_ids, labels, valid))
