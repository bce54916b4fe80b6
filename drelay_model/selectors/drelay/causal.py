"""Causal Selector (§4.3, Appendix B): KEEP or REPAIR each slot against the selected prefix.

Prefix-independent evidence (computed once per block, before any decision):
  states    a_ik = LN(z_i + c_ik + R_k + w_q·log q_ik)  (k < K: candidates),  a_iK = LN(z_i + t_slot)
  history   y_ik = NullAttn(W_q a_ik; keys/values of LN(W_F f_t) + P_t)   the last N strictly verified
            target features f_t, read once per block (all-masked → zero read)
  compact   pre_ik = W_a a_ik + W_y y_ik + b     (W_y also serves as the history read's output map)
            [C or 2C: with `branches: separate` the rank and gate branches' halves side by side]
  rank base S⁰_ik = log q_ik + ⟨W_ρ s_i, ê_ik⟩/√d      native log-prob + shared hidden residual
  gate base g⁰_i  = log Σ_{k>0} q_ik − log q_i0                              native log-odds (Eq. 6)

Prefix memory: entry 0 is the anchor, entry j ≥ 1 the token x_j chosen at slot j (position j):
  m_0 = LN(g_a + p_0 + A + W_x E(x_0)),   m_j = LN(W_m [s_j ; z_j] + p_j + W_x E(x_j))
  A = LN(W_F f_a): f_a is the newest verified target feature (the one that produced the anchor; A = 0
  when there is none), projected exactly as the history read projects its entries (W_F and LN are
  shared, so the anchor projection adds no parameters); A = 0 with `anchor_feature: false`
Decision at position i (slot i−1 in 0-based tensors) reads entries j < i only, and the latest chosen
token conditions its query directly:
  o_ik = Attn(W_p a_ik + W_e E(x_{i−1}); keys/values W_kv m_j for j < i)
  [ρ'_ik, δ_ik] = W_h GELU(pre_ik + W_c o_ik)         W_h zero-initialised (terminal)
    branches "separate" (§5: "separate KEEP/REPAIR and ranking branches"): two MLPs of width C
      ρ'_ik = w_ρ · GELU(pre^ρ_ik + W^ρ_c o_ik) + b_ρ,   δ_ik = w_δ · GELU(pre^δ_ik + W^δ_c o_ik) + b_δ
      (stored as one width-2C layer per input with a block-diagonal W_h, `BranchHeads`)
    branches "shared": one MLP of width C with the 2-column W_h
  S_ik = S⁰_ik + ρ'_ik   (k < K),   g_i = g⁰_i + Δg_i                                   (`combine`)
  Δg_i = δ_iK + Σ_{k>0} r_ik δ_ik − δ_i0   (gate_evidence "contrast", r = softmax_{k>0} S_i, detached:
         the gate reads which alternative the evidence supports against the native's own evidence)
  Δg_i = δ_iK                              (gate_evidence "slot": the slot query alone)
  decision (Eq. 2): REPAIR with k* = argmax_{k>0} S_ik iff g_i + log r_ik* > 0 (ties → KEEP)

With W_ρ = 0 and W_h = 0 (the initialisation) S = log q and g = g⁰: p_act is the native
distribution renormalised over the pool and the rule keeps candidate 0 everywhere.

Execution: `sequential` is the literal algorithm (H dependent decisions); `decide_block` reaches
the same decisions with a few parallel passes (see there); `teacher_forced` is one such pass with
given tokens (training).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from drelay_model.kernels.cpu_linear import PackedLinear
from drelay_model.selectors.drelay.config import DRelayConfig
from drelay_model.selectors.drelay.global_read import null_attention, null_read

# A decision margin g + log r* within this many nats of zero is a numerical tie and resolves to KEEP.
# (float32 log-probs near −20 carry ~2e-6 rounding; 1e-4 nats is a probability ratio of 1.0001.)
TIE_TOL = 1e-4
_LOGQ_FLOOR = -30.0  # log q below this carries no extra information as an input feature


def repair_margin(gate: torch.Tensor, rank: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantity Eq. 2's rule thresholds: m_i = g_i + log r_ik*, r_ik = softmax_{k>0}(S_ik).

    Args:
        gate [...] gate logits g; rank [..., K] scores S (column 0, the native score, is unused).
    Returns:
        (margin [...] float, k* [...] int64 pool index of the best alternative; the lowest on ties).
    """
    alt = rank[..., 1:]
    best, arg = alt.max(dim=-1)
    return gate + (best - alt.logsumexp(dim=-1)), arg + 1


def combine(out: torch.Tensor, gate0: torch.Tensor, rank0: torch.Tensor, *, contrast: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores from the compact heads' output (see the module docstring).

    out [..., K+1, 2] (column 0: rank correction ρ', column 1: gate evidence δ; row K = the slot
    query); gate0 [...]; rank0 [..., K] → (gate g [...], rank S [..., K]).
    """
    K = rank0.shape[-1]
    rank = rank0 + out[..., :K, 0]
    delta = out[..., K, 1]
    if contrast:
        r = rank[..., 1:].detach().softmax(dim=-1)  # [..., K−1] which alternative the rank favours
        delta = delta + (r * out[..., 1:K, 1]).sum(dim=-1) - out[..., 0, 1]
    return gate0 + delta, rank


def decide(gate: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
    """The KEEP/REPAIR rule of Eq. 2: REPAIR with k* iff g_i + log r_ik* > TIE_TOL, else KEEP
    (pool index 0). gate [...], rank [..., K] → [...] int64 pool index."""
    margin, best = repair_margin(gate, rank)
    return torch.where(margin > TIE_TOL, best, torch.zeros_like(best))


class BranchHeads(nn.Module):
    """The terminal layer of separate rank and gate branches: hidden [..., 2C] holds the rank
    branch's C units, then the gate branch's C units; out[..., 0] = w_ρ · hidden[..., :C] + b_ρ,
    out[..., 1] = w_δ · hidden[..., C:] + b_δ (no weight reads the other branch's units).

    weight [2, C] (row 0: w_ρ, row 1: w_δ), bias [2]; `dense()` = the equivalent block-diagonal
    [2, 2C] matrix of a plain linear layer (the walk and its kernel take that)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(2, width))
        self.bias = nn.Parameter(torch.zeros(2))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        C = self.weight.shape[1]
        return (hidden.unflatten(-1, (2, C)) * self.weight).sum(dim=-1) + self.bias  # [..., 2]

    def dense(self) -> torch.Tensor:
        return torch.block_diag(self.weight[:1], self.weight[1:])  # [2, 2C]


@dataclass(frozen=True)
class Evidence:
    """Everything a decision needs that does not depend on the chosen prefix.

    rank0     [B, H, K]         S⁰ = log q + shared hidden residual
    anchor    [B, d]            the anchor's memory base g_a + p_0 (+ LN(W_F f_a))
    gate0     [B, H]            native pool-mass log-odds (Eq. 6 without Δg)
    pre       [B, H, K+1, C]    compact pre-activations (global + history evidence); row K = slot query
    query     [B, H, nh, K+1, dg] prefix-read query base (r = nh·dg = read_dim)
    slot_mem  [B, H, d]         the slot part W_m [s_j ; z_j] + p_j of memory entries j = 1..H
    """

    rank0: torch.Tensor
    anchor: torch.Tensor
    gate0: torch.Tensor
    pre: torch.Tensor
    query: torch.Tensor
    slot_mem: torch.Tensor


class CausalSelector(nn.Module):
    """Evidence, prefix memory, rank/gate heads and the decision loop (see the module docstring)."""

    def __init__(self, cfg: DRelayConfig, *, num_slots: int, top_k: int, feature_dim: int) -> None:
        super().__init__()
        d, r, C, H = cfg.d_sel, cfg.read_dim, cfg.compact_width, num_slots
        self.heads, self.history_len = cfg.heads, cfg.history_len
        self.contrast = cfg.gate_evidence == "contrast"
        self.rank_pos = nn.Parameter(torch.randn(top_k, d) * 0.02)  # R_k
        self.logq_feat = nn.Parameter(torch.randn(d) * 0.02)  # w_q
        self.slot_token = nn.Parameter(torch.randn(d) * 0.02)  # t_slot
        self.state_norm = nn.LayerNorm(d, eps=cfg.ln_eps)
        self.anchor_feature = cfg.anchor_feature
        if cfg.features_needed:  # verified target features: the history read's entries and/or f_a
            self.hist_in = PackedLinear(feature_dim, d)  # W_F: verified target features F → d_sel
            self.hist_norm = nn.LayerNorm(d, eps=cfg.ln_eps)
        if cfg.history_len:
            self.hist_pos = nn.Parameter(torch.randn(cfg.history_len, d) * 0.02)  # P_t, right-aligned
            self.hist_q = PackedLinear(d, r, bias=False)
            self.hist_kv = PackedLinear(d, 2 * r, bias=False)
            self.static_y = PackedLinear(r, C, bias=False)  # W_y (the read's output projection folded in)
        self.static_a = PackedLinear(d, C)  # W_a, b
        self.shared = PackedLinear(d, d, bias=False)  # W_ρ (terminal: zero-init)
        self.anchor_flag = nn.Parameter(torch.randn(d) * 0.02)  # g_a
        self.mem_pos = nn.Parameter(torch.randn(H + 1, d) * 0.02)  # p_j, j = 0 (anchor) .. H
        self.mem_slot = PackedLinear(2 * d, d)  # W_m on [s_j ; z_j]
        self.tok_proj = PackedLinear(d, d + r, bias=False)  # [W_x ; W_e] on E(x): memory part, query part
        self.mem_norm = nn.LayerNorm(d, eps=cfg.ln_eps)
        self.mem_kv = PackedLinear(d, 2 * r, bias=False)
        self.prefix_q = PackedLinear(d, r, bias=False)  # W_p
        self.prefix_out = PackedLinear(r, C, bias=False)  # W_c
        # W_h: [rank correction, gate correction] (terminal: zero-init)
        self.head = BranchHeads(cfg.compact_dim) if cfg.branches == "separate" else PackedLinear(C, 2)
        for p in self.residual_heads():
            nn.init.zeros_(p)

    def residual_heads(self) -> list[nn.Parameter]:
        """The zero-initialised terminal layers (W_ρ, W_h)."""
        return [self.shared.weight, self.head.weight, self.head.bias]

    def output_layer(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_h as a plain linear layer: (weight [2, C or 2C], bias [2])."""
        weight = self.head.dense() if isinstance(self.head, BranchHeads) else self.head.weight
        return weight, self.head.bias

    # ---- prefix-independent evidence -----------------------------------------------------------
    def evidence(self, s, z, c, cand_emb, cand_logq, history, history_mask) -> Evidence:
        """s, z [B, H, d]; c, cand_emb [B, H, K, d]; cand_logq [B, H, K]; history [B, N, F] or None,
        history_mask [B, N] bool or None (the newest N verified features, right-aligned: entry N−1 is
        the anchor's f_a). Returns the block's Evidence."""
        B, H, K, d = c.shape
        nh, r = self.heads, self.prefix_q.out_features
        feat = self.rank_pos + self.logq_feat * cand_logq.clamp(min=_LOGQ_FLOOR).unsqueeze(-1).to(c.dtype)
        rows = torch.cat([c + feat, self.slot_token.expand(B, H, 1, d)], dim=2)  # [B, H, K+1, d]
        a = self.state_norm(z.unsqueeze(2) + rows)  # [B, H, K+1, d]
        pre = self.static_a(a)  # [B, H, K+1, C]
        if self.history_len and history is not None:
            window, window_mask = history[:, -self.history_len :], history_mask[:, -self.history_len :]
            pre = pre + self.static_y(self._history_read(a, window, window_mask))
        rho = (cand_emb @ self.shared(s).unsqueeze(-1)).squeeze(-1) / math.sqrt(d)  # [B, H, K]
        logq = cand_logq.to(c.dtype)
        return Evidence(
            rank0=logq + rho,
            anchor=self._anchor_base(history, history_mask, batch=B, dtype=c.dtype),
            gate0=logq[..., 1:].logsumexp(dim=-1) - logq[..., 0],
            pre=pre,
            query=self.prefix_q(a).view(B, H, K + 1, nh, r // nh).transpose(2, 3),
            slot_mem=self.mem_slot(torch.cat([s, z], dim=-1)) + self.mem_pos[1 : H + 1],
        )

    def _anchor_base(self, history, history_mask, *, batch: int, dtype) -> torch.Tensor:
        """g_a + p_0 (+ LN(W_F f_a), zero where the row has no verified feature yet) → [B, d]."""
        base = (self.anchor_flag + self.mem_pos[0]).to(dtype).expand(batch, -1)
        if not self.anchor_feature or history is None:
            return base
        f_a = self.hist_norm(self.hist_in(history[:, -1].to(dtype)))  # [B, d]
        return base + f_a * history_mask[:, -1:].to(dtype)

    def _history_read(self, a: torch.Tensor, history: torch.Tensor, history_mask: torch.Tensor | None) -> torch.Tensor:
        """Candidate-specific reads of the verified history (heads concatenated, before W_y).
        a [B, H, K+1, d] → [B, H, K+1, r]."""
        B, H, K1, d = a.shape
        N, nh, r = history.shape[1], self.heads, self.hist_q.out_features
        if N > self.history_len:
            raise ValueError(f"history holds {N} entries; this selector reads at most {self.history_len}")
        mem = self.hist_norm(self.hist_in(history.to(a.dtype))) + self.hist_pos[self.history_len - N :]  # [B, N, d]
        k, v = self.hist_kv(mem).view(B, N, 2, nh, r // nh).permute(2, 0, 3, 1, 4)  # [B, nh, N, dg]
        q = self.hist_q(a).view(B, H * K1, nh, r // nh).transpose(1, 2)  # [B, nh, H(K+1), dg]
        read = null_read(q, k, v, key_mask=history_mask)  # all-masked rows read zero
        return read.transpose(1, 2).reshape(B, H, K1, r)

    # ---- prefix memory ---------------------------------------------------------------------------
    def token_terms(self, base: torch.Tensor, tok_emb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What a chosen token x contributes: its memory entry m = LN(base + W_x E(x)) as key and
        value, and the query term W_e E(x) of the next decision.

        base, tok_emb [..., d] (base = W_m [s_j ; z_j] + p_j, or g_a + p_0 for the anchor).
        Returns:
            k, v, q_term, each [..., r].
        """
        mem, q_term = self.tok_proj(tok_emb).split((base.shape[-1], self.prefix_q.out_features), dim=-1)
        k, v = self.mem_kv(self.mem_norm(base + mem)).chunk(2, dim=-1)
        return k, v, q_term

    def _corrections(self, pre: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
        """Compact MLP(s). pre [..., K+1, C or 2C], read [..., K+1, r] → [..., K+1, 2] (rank, gate)."""
        return self.head(F.gelu(pre + self.prefix_out(read)))

    # ---- decisions -------------------------------------------------------------------------------
    def teacher_forced(
        self, ev: Evidence, anchor_emb: torch.Tensor, prefix_emb: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """All H decisions in parallel with given prefix tokens (training; inference passes).

        Args:
            anchor_emb [B, d]; prefix_emb [B, H, d] embeddings of the tokens at slots 0..H−1.
        Returns:
            gate [B, H], rank [B, H, K].
        """
        B, H, nh, K1, dh = ev.query.shape
        tokens = torch.cat([anchor_emb[:, None], prefix_emb[:, : H - 1]], dim=1)  # [B, H, d] positions 0..H−1
        base = torch.cat([ev.anchor[:, None], ev.slot_mem[:, : H - 1]], dim=1)
        k, v, q_term = self.token_terms(base, tokens)  # entry e = position e; q_term[:, e] is x_{i−1} of slot e
        keys, values = (t.view(B, H, nh, dh).transpose(1, 2) for t in (k, v))  # [B, nh, H, dh]
        q = (ev.query + q_term.view(B, H, nh, 1, dh)).transpose(1, 2).reshape(B, nh, H * K1, dh)
        slot = torch.arange(H, device=q.device).repeat_interleave(K1)  # [H(K+1)] slot of each query
        hidden = torch.arange(H, device=q.device)[:, None] > slot[None, :]  # [H, H(K+1)]: entry e is visible to slot s iff e ≤ s
        strict = torch.zeros(hidden.shape, dtype=q.dtype, device=q.device).masked_fill(hidden, float("-inf"))
        read = null_attention(q, keys, values, bias=strict, null_key=False)  # [B, nh, H(K+1), dh]
        read = read.view(B, nh, H, K1, dh).permute(0, 2, 3, 1, 4).reshape(B, H, K1, nh * dh)
        out = self._corrections(ev.pre, read)  # [B, H, K+1, 2]
        return combine(out, ev.gate0, ev.rank0, contrast=self.contrast)

    def sequential(self, ev: Evidence, anchor_emb: torch.Tensor, cand_emb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The H dependent decisions, one after another: after decision i only the chosen token's
        entry is written into the memory that decision i + 1 reads.

        Args:
            anchor_emb [B, d]; cand_emb [B, H, K, d].
        Returns:
            pool_index [B, H] int64, gate [B, H], rank [B, H, K].
        """
        B, H, nh, K1, dh = ev.query.shape
        r = nh * dh
        keys = cand_emb.new_empty(B, nh, H, dh)  # entries 0..H−1 (the last slot's is never read)
        values = cand_emb.new_empty(B, nh, H, dh)
        k, v, q_term = self.token_terms(ev.anchor, anchor_emb)  # [B, r] each: the anchor
        query, pre = ev.query.transpose(0, 1).contiguous(), ev.pre.transpose(0, 1).contiguous()  # slot-major
        rows = torch.arange(B, device=keys.device)
        picks, gates, ranks = [], [], []
        for i in range(H):
            keys[:, :, i], values[:, :, i] = k.view(B, nh, dh), v.view(B, nh, dh)
            q = query[i] + q_term.view(B, nh, 1, dh)  # [B, nh, K+1, dh]
            read = F.scaled_dot_product_attention(q, keys[:, :, : i + 1], values[:, :, : i + 1])
            out = self._corrections(pre[i], read.transpose(1, 2).reshape(B, K1, r))  # [B, K+1, 2]
            gate, rank = combine(out, ev.gate0[:, i], ev.rank0[:, i], contrast=self.contrast)
            pick = decide(gate, rank)  # [B]
            if i + 1 < H:  # only the chosen token becomes visible to later decisions
                k, v, q_term = self.token_terms(ev.slot_mem[:, i], cand_emb[rows, i, pick])
            picks.append(pick)
            gates.append(gate)
            ranks.append(rank)
        return torch.stack(picks, 1), torch.stack(gates, 1), torch.stack(ranks, 1)

    def decide_block(
        self, ev: Evidence, anchor_emb: torch.Tensor, cand_emb: torch.Tensor, *, max_passes: int = 4
    ) -> tuple[torch.Tensor, ...]:
        """The same decisions as `sequential`, found by parallel passes (fewer small ops on CPU).

        Pass t evaluates all H decisions at once under an assumed path P (first the native one) and
        gets D = decide(P). If D == P, every decision was made with exactly the prefix it chose:
        that is the sequential result. Otherwise P ← D; the slots up to the first change are
        settled, so each pass settles at least one more slot and a block with r repairs usually
        needs r + 1 passes or fewer. After `max_passes` it falls back to `sequential`.

        Returns:
            pool_index [B, H] int64, gate [B, H], rank [B, H, K].
        """
        B, H, K, d = cand_emb.shape
        path = torch.zeros(B, H, dtype=torch.long, device=cand_emb.device)
        for _ in range(max_passes):
            chosen = cand_emb.gather(2, path[:, :, None, None].expand(B, H, 1, d)).squeeze(2)  # [B, H, d]
            gate, rank = self.teacher_forced(ev, anchor_emb, chosen)
            new = decide(gate, rank)
            if torch.equal(new, path):
                return path, gate, rank
            path = new
        return self.sequential(ev, anchor_emb, cand_emb)
