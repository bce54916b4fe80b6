"""`domino`: a GRU over the selected prefix produces a vocabulary residual on each slot's logits,
applied slot by slot (Domino, "Decoupling Causal Modeling from Autoregressive Drafting").

    g_{−1} = 0,   g_i = GRU(W_x E(x_{i−1}) + W_h h_i, g_{i−1}),   x_{−1} = the anchor     [B, d]
    post_i(v) = log q_i(v) + ⟨W_o g_i, E(v)⟩          W_o: d → D_emb, zero-initialised
The residual is a full-vocabulary term (a low-rank map through the frozen embedding); as every
selector here picks from the pool, it is evaluated on the K pool entries, and the served token is
the post-residual argmax over the pool: x_i = v_{i, argmax_k post_i(v_ik)}. x_i then enters the GRU
for slot i+1, so slot i's residual depends on the tokens actually chosen at slots < i.

Training (Domino's mixed objective): teacher-forced prefix (the anchor, then the target's labels)
    ℓ_i = (1 − λ_t) CE_pool(post_i, y_i) + λ_t CE_pool(log q_i, y_i),
    λ_t = max(0, 1 − progress / base_decay)           the base-head weight decays to 0
(CE over the pool where y_i is in it, else 0). The dense support CE of the joint step remains the
base head's full-vocabulary term.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from drelay_model.drafter.model import DraftBlock
from drelay_model.selectors.base import Selection, SelectionContext, SelectorCapabilities, SelectorTrainInputs, SelectorTrainLoss
from drelay_model.selectors.heads import HeadConfig, PoolHead, PoolTargets, choice_metrics, pool_nll, positive_int, zero_init


@dataclass(frozen=True)
class DominoConfig(HeadConfig):
    """d: GRU width; base_decay: fraction of training over which the base-head CE weight λ decays 1 → 0."""

    selector_name = "domino"
    d: int = 128
    base_decay: float = 0.5

    def checks(self) -> dict[str, bool]:
        return {"d": positive_int(self.d), "base_decay": isinstance(self.base_decay, float) and 0.0 < self.base_decay <= 1.0}


class DominoSelector(PoolHead):
    capabilities = SelectorCapabilities(trainable=True, needs_hidden=True, supports_sampling=True)
    config_cls = DominoConfig

    def __init__(self, config: DominoConfig, **sizes):
        super().__init__(config, **sizes)
        D, E, d = self.hidden_size, self.embed_weight.shape[1], config.d
        self.token_in = nn.Linear(E, d, bias=False)  # W_x
        self.slot_in = nn.Linear(D, d)  # W_h
        self.gru = nn.GRUCell(d, d)
        self.out = zero_init(nn.Linear(d, E, bias=False))  # W_o

    def step_inputs(self, block: DraftBlock, prev_ids: torch.Tensor) -> torch.Tensor:
        """GRU inputs W_x E(x_{i−1}) + W_h h_i for the given predecessors prev_ids [B, H] → [B, H, d]."""
        return self.token_in(self.embed(prev_ids)) + self.slot_in(block.hidden.to(self.dtype))

    def cand_codes(self, cand_ids: torch.Tensor) -> torch.Tensor:
        """W_oᵀ E(v) for pool ids [..., K] → [..., K, d], so that ⟨W_o g, E(v)⟩ = ⟨g, W_oᵀ E(v)⟩."""
        return self.embed(cand_ids) @ self.out.weight

    @staticmethod
    def residual(g: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """⟨W_o g, E(v)⟩ for states g [..., d] and candidate codes [..., K, d] → [..., K] float32."""
        return torch.einsum("...d,...kd->...k", g, codes).float()

    @torch.inference_mode()
    def select(self, block: DraftBlock, ctx: SelectionContext) -> Selection:
        B, H, K = self.check_block(block)
        h_in = self.slot_in(block.hidden.to(self.dtype))  # [B, H, d]
        codes = self.cand_codes(block.cand_ids)  # [B, H, K, d]
        tok_in = self.token_in(self.embed(block.cand_ids))  # [B, H, K, d] W_x E(v) of every candidate
        x_prev = self.token_in(self.embed(ctx.anchor_ids))  # [B, d] the anchor enters first
        g = h_in.new_zeros(B, self.config.d)
        pick = torch.zeros(B, H, dtype=torch.long, device=block.cand_ids.device)
        for i in range(H):  # slot by slot: the residual sees the tokens chosen so far
            g = self.gru(x_prev + h_in[:, i], g)
            post = block.cand_logq[:, i].float() + self.residual(g, codes[:, i])  # [B, K]
            pick[:, i] = post.argmax(dim=-1)
            x_prev = tok_in[:, i].gather(1, pick[:, i, None, None].expand(B, 1, tok_in.shape[-1]))[:, 0]
        return self.gather(block, pick)

    def post_scores(self, block: DraftBlock, prev_ids: torch.Tensor) -> torch.Tensor:
        """Teacher-forced post-residual pool scores for predecessors prev_ids [B, H] → [B, H, K]."""
        x = self.step_inputs(block, prev_ids)  # [B, H, d]
        g, states = x.new_zeros(x.shape[0], self.config.d), []
        for i in range(x.shape[1]):
            g = self.gru(x[:, i], g)
            states.append(g)
        return block.cand_logq.float() + self.residual(torch.stack(states, dim=1), self.cand_codes(block.cand_ids))

    def training_loss(self, inputs: SelectorTrainInputs) -> SelectorTrainLoss:
        block, labels, valid = inputs.block, inputs.labels, inputs.valid
        self.check_block(block)
        prev = torch.cat([inputs.anchor_ids[:, None], labels[:, :-1]], dim=1)  # [B, H]
        post = self.post_scores(block, prev)
        t = PoolTargets.of(block.cand_ids, labels, valid)
        lam = max(0.0, 1.0 - inputs.knobs.progress / self.config.base_decay)
        per_token = (1.0 - lam) * pool_nll(post, t) + lam * pool_nll(block.cand_logq, t)
        metrics = {**choice_metrics(post, block.cand_ids, labels, valid), "selector/base_weight": lam}
        return SelectorTrainLoss(weighted_sum=per_token.sum(), metrics=metrics)
