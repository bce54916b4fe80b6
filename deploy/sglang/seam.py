"""DRelay behind SGLang's DFlash-2 selector seam (pure PyTorch, testable without SGLang).

SGLang's DFLASH worker (spec v2) runs a draft model's `candidate_selector` inside the captured
draft CUDA graph through two calls:
    scores         = build_lattice(candidate_ids, unary_logits, hidden_states, anchor_token_ids)
    tokens, q_rows = sample_path(candidate_ids=…, scores=…, uniforms=…, temperatures=…, greedy_mask=…)
with candidate_ids [bs, H, K] (the pool), unary_logits [bs, H, K], hidden_states [bs, H, D] (slots
1..H) and anchor_token_ids [bs]. `DRelayCandidateSelector` answers them with our selector:
  - unary_logits must be log q (log-softmax over the drafter's full vocabulary, top-K), which is
    what `DRelayDraftModel.compute_candidates` returns;
  - the verified history is read from the worker's `RequestFeatureRing` at the rows' request-pool
    slots, staged into a static buffer before the graph replay (`stage_requests`);
  - build_lattice runs Global Read and the graph-safe decision walk and returns the selection as
    one-hot rows [bs, H, K] (float32);
  - sample_path returns the chosen tokens and those one-hot rows as q. DRelay's path is a
    deterministic function of the pool, so its proposal is a point mass: accepting token x with
    probability min(1, p(x)/q(x)) = p(x) and resampling from norm(max(p − q, 0)) on rejection is
    exactly "the target samples; accept while it matches", which is lossless for any T (greedy:
    the target's argmax). `uniforms`, `temperatures` and `greedy_mask` are therefore unused.
Fixed shapes, no host syncs (checked by a fullgraph compile test).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deploy.sglang.history import RequestFeatureRing
from drelay_model.drafter import DraftBlock
from drelay_model.selectors.drelay import DRelaySelector


class DRelayCandidateSelector(nn.Module):
    def __init__(self, selector: DRelaySelector, *, history: RequestFeatureRing | None, max_bs: int, device="cpu") -> None:
        super().__init__()
        n = selector.capabilities.history_len  # the history read's N, or 1 for the anchor feature alone
        if n and (history is None or history.size != n):
            raise ValueError(f"the selector reads {n} verified features; give a RequestFeatureRing of that size")
        self.selector = selector.eval()
        self.history = history if n else None
        self.top_k = selector.top_k
        self.register_buffer("slots", torch.zeros(max_bs, dtype=torch.long, device=device), persistent=False)  # [max_bs]

    def stage_requests(self, req_pool_indices: torch.Tensor) -> None:
        """Host side, before the graph replay: the request-pool slot of each batch row."""
        self.slots[: req_pool_indices.shape[0]].copy_(req_pool_indices)

    @torch.no_grad()
    def build_lattice(self, candidate_ids, unary_logits, hidden_states, anchor_token_ids) -> torch.Tensor:
        """candidate_ids [bs, H, K] int64, unary_logits [bs, H, K] log q, hidden_states [bs, H, D],
        anchor_token_ids [bs] → one-hot selection [bs, H, K] float32."""
        bs, H, K = candidate_ids.shape
        block = DraftBlock(hidden=hidden_states, cand_ids=candidate_ids, cand_logq=unary_logits.float())
        history, mask = self.history.read(self.slots[:bs]) if self.history is not None else (None, None)
        ev, cand_emb = self.selector.evidence(block, history, mask)
        res = self.selector.walk_decisions(ev, self.selector.embed(anchor_token_ids), cand_emb)
        return F.one_hot(res.pool_index, K).float()

    def sample_path(self, *, candidate_ids, scores, uniforms=None, temperatures=None, greedy_mask=None):
        """→ (tokens [bs, H] int64, q_rows [bs, H, K] float32 point-mass proposals)."""
        pick = scores.argmax(dim=-1, keepdim=True)  # [bs, H, 1]
        return candidate_ids.gather(-1, pick).squeeze(-1), scores


def seam_for(selector, drafter_config, *, dtype, max_requests: int, max_bs: int, device="cpu") -> DRelayCandidateSelector | None:
    """The `candidate_selector` for a loaded selector, with a verified-feature ring of its history
    length for `max_requests` request-pool slots; None without a selector."""
    if selector is None:
        return None
    n = selector.capabilities.history_len  # the history read's N, or 1 for the anchor feature alone
    dim = len(drafter_config.target_layer_ids) * drafter_config.hidden_size
    ring = RequestFeatureRing(max_requests, n, dim, dtype=dtype, device=device) if n else None
    return DRelayCandidateSelector(selector, history=ring, max_bs=max_bs, device=device)
