"""The graph-safe decision walk: the H causal KEEP/REPAIR decisions in order, fixed work per block.

`CausalSelector.decide_block` finds the decisions with up to four parallel passes, each ending in a
host sync (`torch.equal`), and falls back to a Python loop; neither can live inside a captured CUDA
graph. The walk reaches the same decisions with the literal algorithm, arranged so that every
tensor has a static shape and nothing reads a value back to the host:

  1. everything a chosen token could contribute is prefix-independent, so it is computed for every
     candidate at once (`walk_inputs`):
        memory entry of candidate k at slot j:  k_jk, v_jk = W_kv LN(W_m[s_j; z_j] + p_j + W_x E(v_jk))
        its query term for decision j + 1:      q_jk = W_e E(v_jk)
     (entry 0, the anchor, likewise from its base g_a + p_0 (+ LN_A(W_A f_a)) and E(x_0));
  2. decision i (0-based slot, position i + 1) then only gathers the picked candidate's terms:
        o_ik  = softmax_j≤i((Q_ik + q_{i−1,x})·k_j / √d_g) v_j      per head, entries 0..i
        [ρ'_ik, δ_ik] = W_h GELU(pre_ik + W_c o_ik)
        S_ik = S⁰_ik + ρ'_ik,  g_i = g⁰_i + Δg_i (causal.combine),  pick_i = decide(g_i, S_i)
     a Python loop over the static H (unrolled by a compiler), with `gather` for the picked index.

The same decisions as `sequential` and `decide_block` (the scores agree to float rounding; picks can
differ only where g + log r* lies within rounding of the tie tolerance). `walk` is the PyTorch
reference; `drelay_model/kernels/walk.py` runs the same loop as one Triton program per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from drelay_model.selectors.drelay.causal import CausalSelector, Evidence, combine, decide


@dataclass(frozen=True)
class WalkInputs:
    """Everything the walk reads (all prefix-independent). r = nh·d_g, C = compact width (both
    branches' units with `branches: separate`).

    query     [B, H, nh, K+1, d_g]  prefix-read query base W_p a_ik (row K = the slot query)
    pre       [B, H, K+1, C]        compact pre-activations
    rank0     [B, H, K]             S⁰
    gate0     [B, H]                g⁰
    anchor_k, anchor_v, anchor_q    [B, r]        memory entry 0 and the query term of decision 0
    cand_k, cand_v, cand_q          [B, H, K, r]  the same for every candidate of every slot
    out_w     [C, r]  W_c;  head_w [2, C], head_b [2]  W_h (row 0: rank, row 1: gate)
    contrast  the gate residual reads the alternatives against the native (causal.combine)
    """

    query: torch.Tensor
    pre: torch.Tensor
    rank0: torch.Tensor
    gate0: torch.Tensor
    anchor_k: torch.Tensor
    anchor_v: torch.Tensor
    anchor_q: torch.Tensor
    cand_k: torch.Tensor
    cand_v: torch.Tensor
    cand_q: torch.Tensor
    out_w: torch.Tensor
    head_w: torch.Tensor
    head_b: torch.Tensor
    contrast: bool


@dataclass(frozen=True)
class WalkResult:
    """pool_index [B, H] int64; gate [B, H]; rank [B, H, K] (the scores each decision saw)."""

    pool_index: torch.Tensor
    gate: torch.Tensor
    rank: torch.Tensor


def walk_inputs(causal: CausalSelector, ev: Evidence, anchor_emb: torch.Tensor, cand_emb: torch.Tensor) -> WalkInputs:
    """Step 1 of the module docstring. anchor_emb [B, d]; cand_emb [B, H, K, d]."""
    ak, av, aq = causal.token_terms(ev.anchor, anchor_emb)  # [B, r] each
    ck, cv, cq = causal.token_terms(ev.slot_mem[:, :, None], cand_emb)  # [B, H, K, r] each
    head_w, head_b = causal.output_layer()  # [2, C], [2] (block-diagonal with separate branches)
    return WalkInputs(
        query=ev.query,  # [B, H, nh, K+1, d_g]
        pre=ev.pre,
        rank0=ev.rank0,
        gate0=ev.gate0,
        anchor_k=ak,
        anchor_v=av,
        anchor_q=aq,
        cand_k=ck,
        cand_v=cv,
        cand_q=cq,
        out_w=causal.prefix_out.weight,
        head_w=head_w,
        head_b=head_b,
        contrast=causal.contrast,
    )


def walk(w: WalkInputs) -> WalkResult:
    """Step 2 of the module docstring: H decisions in order, static shapes, no host syncs.

    Each candidate's terms are laid out once per block as one row [k (nh × d_g) | v | q] with k and
    v interleaved per head, so a decision costs one gather for the pick and one concatenation for
    the memory (about 20 small ops per slot: this loop is the CPU's select-phase critical path)."""
    B, H, nh, K1, dh = w.query.shape
    r = nh * dh
    per_head = lambda t: t.reshape(*t.shape[:-1], nh, dh)  # noqa: E731  [..., r] → [..., nh, d_g]
    cand = torch.cat([torch.cat([per_head(w.cand_k), per_head(w.cand_v)], -1).flatten(-2), w.cand_q], -1)  # [B, H, K, 3r]
    memory = torch.cat([per_head(w.anchor_k), per_head(w.anchor_v)], -1)[:, :, None]  # [B, nh, 1, 2 d_g] entry 0
    q_term = w.anchor_q
    picks, gates, ranks = [], [], []
    for i in range(H):
        q = w.query[:, i] + q_term.view(B, nh, 1, dh)  # [B, nh, K+1, d_g]
        read = F.scaled_dot_product_attention(q, memory[..., :dh], memory[..., dh:])  # entries 0..i
        read = read.transpose(1, 2).reshape(B, K1, r)  # [B, K+1, r]
        out = F.linear(F.gelu(w.pre[:, i] + F.linear(read, w.out_w)), w.head_w, w.head_b)  # [B, K+1, 2]
        gate, rank = combine(out, w.gate0[:, i], w.rank0[:, i], contrast=w.contrast)
        pick = decide(gate, rank)  # [B] int64
        row = cand[:, i].gather(1, pick[:, None, None].expand(-1, 1, 3 * r))[:, 0]  # [B, 3r] the pick's terms
        memory = torch.cat([memory, row[:, : 2 * r].view(B, nh, 1, 2 * dh)], dim=2)
        q_term = row[:, 2 * r :]
        picks.append(pick)
        gates.append(gate)
        ranks.append(rank)
    return WalkResult(pool_index=torch.stack(picks, 1), gate=torch.stack(gates, 1), rank=torch.stack(ranks, 1))
