"""The select phase on CPU without repeated work: the same math as `DRelaySelector.evidence` +
`walk_inputs` + `walk` (the reference, kept as `select_with_scores(..., reference=True)` and as the
CUDA path), arranged so that a round computes only what it has not computed before.

What changes against the reference (the values do not: see caches.py for why each is exact):
  - per-token rows (ê = W_e E(v), W_n ê, [W_x ; W_e'] ê) come from a table filled once per token,
    instead of three projections of all B·H·K pool entries every round;
  - the verified-history projection LN(W_F f_t) is computed once per feature, not once per round
    for the whole window (HistoryCache);
  - the three linears of the candidate state a_ik (W_a, the history query, W_p) run as one;
  - the walk keeps its prefix memory in one buffer written in place and gathers the picked
    candidate's terms with one `index_select` over the flattened pool.
Decisions and scores equal the reference's bit for bit (tests/model/test_drelay_fast.py replays
blocks recorded from real decoding). Host syncs happen (the history check, the token table's
misses), so this path is CPU only; CUDA keeps the graph-safe reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from drelay_model.drafter.model import DraftBlock
from drelay_model.selectors.base import SelectionContext
from drelay_model.selectors.drelay.caches import FusedLinear, HistoryCache, TokenTable, packs
from drelay_model.selectors.drelay.causal import _LOGQ_FLOOR, TIE_TOL
from drelay_model.selectors.drelay.global_read import null_read


@dataclass(frozen=True)
class FastResult:
    """pool_index [B, P] int64; gate [B, P]; rank [B, P, K] (the scores each decision saw)."""

    pool_index: torch.Tensor
    gate: torch.Tensor
    rank: torch.Tensor


class FastSelect:
    """Caches of one selector's CPU fast path (held by the selector, never saved or copied)."""

    def __init__(self) -> None:
        self.tokens = TokenTable()
        self.history = HistoryCache()
        self._fused: FusedLinear | None = None
        self._memory: WalkMemory | None = None

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def __deepcopy__(self, memo) -> "FastSelect":
        return FastSelect()

    def select(self, sel, block: DraftBlock, ctx: SelectionContext, slots: int) -> FastResult:
        """The first `slots` = P ≤ H decisions of `sel` on `block` (see the module docstring)."""
        B, H, K = block.cand_ids.shape
        cr, dtype = sel.causal, sel.embed_in.weight.dtype
        P = slots
        s = sel.slot_norm(sel.slot_in(block.hidden.to(dtype))) + sel.slot_pos[:H]  # [B, H, d]
        emb, n_part, tok = self.token_rows(sel, block.cand_ids)  # [B, H, K, d], [B, H, K, d] | None, [B, H, K, d + r]
        if sel.global_read is not None:
            z, c = global_read(sel.global_read, s, emb, n_part, block.cand_logq)
        else:
            z, c = s, emb
        logq = block.cand_logq
        if P < H:
            s, z, c, emb, tok, logq = s[:, :P], z[:, :P], c[:, :P], emb[:, :P], tok[:, :P], logq[:, :P]
        history = ctx.history if sel.config.features_needed else None
        mask = None
        if history is not None:
            mask = ctx.history_mask if ctx.history_mask is not None else torch.ones(history.shape[:2], dtype=torch.bool)
        projected = self.project_history(cr, history, ctx) if history is not None else None  # [B, N', d]
        query, pre = self.candidate_states(cr, z, c, logq, projected, mask)
        d = s.shape[-1]
        rho = (emb @ cr.shared(s).unsqueeze(-1)).squeeze(-1) / math.sqrt(d)  # [B, P, K]
        logq = logq.to(c.dtype)
        anchor = (cr.anchor_flag + cr.mem_pos[0]).to(c.dtype).expand(B, -1)  # [B, d]
        if cr.anchor_feature and history is not None:  # f_a projected alone, as the reference does: the same
            # row taken from the window's batched projection can round differently (BLAS blocks by rows)
            anchor = anchor + cr.hist_norm(cr.hist_in(history[:, -1].to(c.dtype))) * mask[:, -1:].to(c.dtype)
        slot_mem = cr.mem_slot(torch.cat([s, z], dim=-1)) + cr.mem_pos[1 : P + 1]  # [B, P, d]
        _, _, anchor_tok = self.token_rows(sel, ctx.anchor_ids)  # [B, d + r]
        return lean_walk(
            cr,
            self.walk_memory(B, P, cr, query.shape[-1], c.dtype),
            query=query,
            pre=pre,
            rank0=logq + rho,
            gate0=logq[..., 1:].logsumexp(dim=-1) - logq[..., 0],
            anchor_terms=cr_terms(cr, anchor, anchor_tok),
            cand_terms=cr_terms(cr, slot_mem[:, :, None], tok),
        )

    def walk_memory(self, B: int, P: int, cr, dh: int, dtype: torch.dtype) -> "WalkMemory":
        """The walk's memory buffer for this shape (kept while rounds keep the shape)."""
        if self._memory is None or self._memory.shape != (B, P, cr.heads, dh, dtype):
            self._memory = WalkMemory(B, P, cr.heads, dh, dtype)
        return self._memory

    def token_rows(self, sel, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """ids [...] → (ê [..., d], W_n ê [..., d] or None without Global Read, [W_x ; W_e'] ê [..., d + r])."""
        cr, gr = sel.causal, sel.global_read
        mods = [sel.embed_in, cr.tok_proj] + ([gr.n_proj] if gr is not None else [])

        def rows(embedded: torch.Tensor) -> tuple[torch.Tensor, ...]:
            e = sel.embed_in(embedded.to(sel.embed_in.weight.dtype))
            return (e, cr.tok_proj(e)) + ((gr.n_proj(e),) if gr is not None else ())

        embed = sel.embed_weight
        if embed.is_inference() or not packs(*mods):  # rows not guaranteed independent: no table
            out = rows(F.embedding(ids, embed))
        else:
            version = (embed.data_ptr(),) + tuple((m.weight.data_ptr(), m.weight._version, m.cpu_kernels) for m in mods)
            out = self.tokens.lookup(ids, embed, rows, version)
        return out[0], (out[2] if gr is not None else None), out[1]

    def project_history(self, cr, history: torch.Tensor, ctx: SelectionContext) -> torch.Tensor:
        """LN(W_F f_t) of the window the selector reads (the last max(history_len, 1) features) → [B, N', d]."""
        window = history[:, -max(cr.history_len, 1) :]

        def proj(feats: torch.Tensor) -> torch.Tensor:
            return cr.hist_norm(cr.hist_in(feats.to(cr.hist_in.weight.dtype)))

        w = cr.hist_in.weight
        if w.is_inference() or not packs(cr.hist_in) or ctx.row_ids is None:
            return proj(window)
        version = (w.data_ptr(), w._version, cr.hist_in.cpu_kernels, cr.hist_norm.weight._version, cr.hist_norm.bias._version)
        return self.history.project(window, ctx.row_ids, ctx.anchor_pos, proj, version)

    def candidate_states(self, cr, z, c, logq, projected, mask) -> tuple[torch.Tensor, torch.Tensor]:
        """a_ik and its three linears at once (W_a, the history query, W_p), plus the history read.
        Returns (query [B, P, nh, K+1, d_g], pre [B, P, K+1, C])."""
        B, P, K, d = c.shape
        nh, r = cr.heads, cr.prefix_q.out_features
        feat = cr.rank_pos + cr.logq_feat * logq.clamp(min=_LOGQ_FLOOR).unsqueeze(-1).to(c.dtype)
        rows = torch.cat([c + feat, cr.slot_token.expand(B, P, 1, d)], dim=2)  # [B, P, K+1, d]
        a = cr.state_norm(z.unsqueeze(2) + rows)
        reads_history = bool(cr.history_len) and projected is not None
        if self._fused is None or len(self._fused.modules) != 2 + reads_history:
            self._fused = FusedLinear(cr.static_a, *((cr.hist_q,) if reads_history else ()), cr.prefix_q)
        C = cr.static_a.out_features
        parts = self._fused(a).split((C, r, r) if reads_history else (C, r), dim=-1)
        pre, q_prefix = parts[0], parts[-1]
        if reads_history:
            N = projected.shape[1]
            mem = projected + cr.hist_pos[cr.history_len - N :]  # [B, N, d]
            k, v = cr.hist_kv(mem).view(B, N, 2, nh, r // nh).permute(2, 0, 3, 1, 4)  # [B, nh, N, d_g]
            q = parts[1].reshape(B, P * (K + 1), nh, r // nh).transpose(1, 2)  # [B, nh, P(K+1), d_g]
            read = null_read(q, k, v, key_mask=mask[:, -N:])
            pre = pre + cr.static_y(read.transpose(1, 2).reshape(B, P, K + 1, r))
        query = q_prefix.reshape(B, P, K + 1, nh, r // nh).transpose(2, 3)  # [B, P, nh, K+1, d_g]
        return query, pre


def global_read(gr, s: torch.Tensor, emb: torch.Tensor, n_part: torch.Tensor, cand_logq: torch.Tensor):
    """`GlobalRead.forward` with W_n ê given (n_part). Returns (z [B, H, d], c [B, H, K, d])."""
    pi = torch.softmax(cand_logq, dim=-1).to(emb.dtype)  # [B, H, K]
    summary = (pi.unsqueeze(-2) @ emb).squeeze(-2)  # [B, H, d]
    x = s + gr.mix_in(summary)
    for block in gr.blocks:
        x = block(x)
    u = gr.u_norm(x)
    n = gr.n_norm(u.unsqueeze(2) + n_part)  # [B, H, K, d]
    read = gr.candidate_read(n, cand_logq, None)
    lam = gr.fusion[: s.shape[1], None]  # [H, 1]
    return s + lam * gr.slot_out(u), emb + lam[..., None] * read


def cr_terms(cr, base: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    """`CausalSelector.token_terms` from tok = [W_x ; W_e'] ê (a token table row): one row
    [k (per head, interleaved with v) | q_term] per token. base [..., d], tok [..., d + r] → [..., 3r]."""
    d, r, nh = base.shape[-1], cr.prefix_q.out_features, cr.heads
    mem, q_term = tok.split((d, r), dim=-1)
    k, v = cr.mem_kv(cr.mem_norm(base + mem)).chunk(2, dim=-1)
    per_head = lambda t: t.reshape(*t.shape[:-1], nh, r // nh)  # noqa: E731
    return torch.cat([torch.cat([per_head(k), per_head(v)], -1).flatten(-2), q_term], -1)


class WalkMemory:
    """The walk's prefix memory, kept across rounds of one shape, with every view a step reads made
    once: entry-major rows [P, B, 2r] (k|v interleaved per head, as `cr_terms` lays them out), so
    the picked candidate's terms are written by one `index_select` into row i + 1, and step i reads
    keys/values of entries 0..i as strided views [B, nh, i+1, d_g] of the same storage."""

    def __init__(self, B: int, P: int, nh: int, dh: int, dtype: torch.dtype) -> None:
        self.shape = (B, P, nh, dh, dtype)
        self.rows = torch.empty(P, B, nh, 2 * dh, dtype=dtype)
        self.row = self.rows.view(P, B, 2 * nh * dh).unbind(0)  # [B, 2r] each
        by_key = self.rows.permute(1, 2, 0, 3)  # [B, nh, P, 2 d_g]
        self.keys = [by_key[:, :, : i + 1, :dh] for i in range(P)]
        self.values = [by_key[:, :, : i + 1, dh:] for i in range(P)]


def lean_walk(cr, memory: WalkMemory, *, query, pre, rank0, gate0, anchor_terms, cand_terms) -> FastResult:
    """`walk.walk`, step for step the same arithmetic, with fewer operations per step: per-slot views
    taken by one `unbind` each, the memory written in place (`WalkMemory`), the picked candidate's
    terms gathered by `index_select` over the flattened pool.

    query [B, P, nh, K+1, d_g]; pre [B, P, K+1, C]; rank0 [B, P, K]; gate0 [B, P];
    anchor_terms [B, 3r]; cand_terms [B, P, K, 3r] (k|v interleaved per head, then q_term)."""
    B, P, nh, K1, dh = query.shape
    K, r = K1 - 1, nh * dh
    out_w, (head_w, head_b) = cr.prefix_out.weight, cr.output_layer()
    memory.row[0].copy_(anchor_terms[:, : 2 * r])
    q_term = anchor_terms[:, 2 * r :]
    flat = cand_terms.reshape(B * P * K, 3 * r)
    flat_kv, flat_q = flat[:, : 2 * r], flat[:, 2 * r :]
    first = (torch.arange(B)[:, None] * (P * K) + torch.arange(P)[None, :] * K).unbind(1)  # [B] row of (b, i, 0)
    queries, pres, rank0s, gate0s = query.unbind(1), pre.unbind(1), rank0.unbind(1), gate0.unbind(1)
    picks, gates, ranks = [], [], []
    for i in range(P):
        q = queries[i] + q_term.view(B, nh, 1, dh)  # [B, nh, K+1, d_g]
        read = F.scaled_dot_product_attention(q, memory.keys[i], memory.values[i])  # entries 0..i
        out = F.linear(F.gelu(pres[i] + F.linear(read.transpose(1, 2).reshape(B, K1, r), out_w)), head_w, head_b)
        rank_out, gate_out = out.unbind(-1)  # [B, K+1] each: causal.combine, column by column
        rank = rank0s[i] + rank_out[:, :K]
        delta = gate_out[:, K]
        if cr.contrast:
            delta = delta + (rank[:, 1:].softmax(dim=-1) * gate_out[:, 1:K]).sum(dim=-1) - gate_out[:, 0]
        gate = gate0s[i] + delta
        alt = rank[:, 1:]  # causal.decide: REPAIR with k* iff g + log r_k* > TIE_TOL
        best, arg = alt.max(dim=-1)
        pick = torch.where(gate + (best - alt.logsumexp(dim=-1)) > TIE_TOL, arg + 1, 0)  # [B] int64
        picks.append(pick)
        gates.append(gate)
        ranks.append(rank)
        if i + 1 < P:
            at = first[i] + pick
            torch.index_select(flat_kv, 0, at, out=memory.row[i + 1])
            q_term = flat_q.index_select(0, at)
    return FastResult(pool_index=torch.stack(picks, 1), gate=torch.stack(gates, 1), rank=torch.stack(ranks, 1))
