"""The causal decision walk (selectors/drelay/walk.py) as one Triton program per row.

Per row b the program keeps the prefix memory (entries 0..H−1, keys and values [H, r]) in
registers and runs the H decisions in order, exactly as `walk`:
    q_ik  = Q_ik + q_{i−1, x}                          (query base + the latest chosen token's term)
    o_ik  = Σ_{j≤i} softmax_j(q_ik·k_j / √d_g) v_j     per head (head h owns columns h·d_g..)
    x_ik  = pre_ik + W_c o_ik;   [ρ', δ]_ik = W_h GELU(x_ik) + b_h
    S_ik  = S⁰_ik + ρ'_ik (k < K),  g_i = g⁰_i + δ_iK
    pick  = argmax_{k>0} S_ik if g_i + max_{k>0} S_ik − logsumexp_{k>0} S_ik > TIE_TOL else 0
and writes the picked candidate's (k, v, q-term) into the memory. Float32 inside; scores are
stored in the input dtype. No host syncs: the whole block is one launch.

H is a compile-time constant: one compiled kernel per slot count (a block drafted with fewer slots
compiles its own once; Triton caches it). A runtime H would be a loop bound the interpreter of Triton
3.6 cannot read (TRITON_INTERPRET=1 raises there), and compiled for sm_90 the constant bound is as
small as the runtime one or smaller (benchmarks/gpu/compile_walk.py; docs/devices.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from drelay_model.selectors.drelay.causal import TIE_TOL
from drelay_model.selectors.drelay.walk import WalkInputs, WalkResult


@triton.jit
def _walk_kernel(
    query_ptr,
    pre_ptr,
    rank0_ptr,
    gate0_ptr,
    ak_ptr,
    av_ptr,
    aq_ptr,
    ck_ptr,
    cv_ptr,
    cq_ptr,
    outw_ptr,
    headw_ptr,
    headb_ptr,
    pick_ptr,
    gate_ptr,
    rank_ptr,
    H: tl.constexpr,
    K,
    C,
    scale,
    tie_tol,
    NH: tl.constexpr,
    DG: tl.constexpr,
    K1P: tl.constexpr,
    HP: tl.constexpr,
    RP: tl.constexpr,
    CP: tl.constexpr,
    CONTRAST: tl.constexpr,
):
    b = tl.program_id(0)
    R = NH * DG
    K1 = K + 1
    offs_k, offs_t = tl.arange(0, K1P), tl.arange(0, HP)
    offs_r, offs_c = tl.arange(0, RP), tl.arange(0, CP)
    km, rm, cm = offs_k < K1, offs_r < R, offs_c < C
    head_of_r = offs_r // DG
    # W_c^T as [r, C]; W_h rows (rank, gate) as [C].
    w_c = tl.load(outw_ptr + offs_c[None, :] * R + offs_r[:, None], mask=rm[:, None] & cm[None, :], other=0.0).to(tl.float32)
    hw_rank = tl.load(headw_ptr + offs_c, mask=cm, other=0.0).to(tl.float32)
    hw_gate = tl.load(headw_ptr + C + offs_c, mask=cm, other=0.0).to(tl.float32)
    hb_rank = tl.load(headb_ptr).to(tl.float32)
    hb_gate = tl.load(headb_ptr + 1).to(tl.float32)
    keys = tl.zeros((HP, RP), dtype=tl.float32)
    vals = tl.zeros((HP, RP), dtype=tl.float32)
    k_new = tl.load(ak_ptr + b * R + offs_r, mask=rm, other=0.0).to(tl.float32)
    v_new = tl.load(av_ptr + b * R + offs_r, mask=rm, other=0.0).to(tl.float32)
    q_term = tl.load(aq_ptr + b * R + offs_r, mask=rm, other=0.0).to(tl.float32)
    for i in range(H):
        keys = tl.where(offs_t[:, None] == i, k_new[None, :], keys)
        vals = tl.where(offs_t[:, None] == i, v_new[None, :], vals)
        # query[b, i, h, k, e] at ((b·H + i)·NH + h)·K1·DG + k·DG + e, column r = h·DG + e
        q_ptrs = query_ptr + ((b * H + i) * NH + head_of_r[None, :]) * K1 * DG + offs_k[:, None] * DG + offs_r[None, :] % DG
        q = tl.load(q_ptrs, mask=km[:, None] & rm[None, :], other=0.0).to(tl.float32) + q_term[None, :]
        read = tl.zeros((K1P, RP), dtype=tl.float32)
        for hh in tl.static_range(NH):
            cols = (head_of_r == hh)[None, :]
            s = tl.dot(tl.where(cols, q, 0.0), tl.trans(keys), input_precision="ieee") * scale  # [K1P, HP]
            s = tl.where(offs_t[None, :] <= i, s, float("-inf"))
            p = tl.exp(s - tl.max(s, axis=1)[:, None])
            p = p / tl.sum(p, axis=1)[:, None]
            read += tl.dot(p, tl.where(cols, vals, 0.0), input_precision="ieee")
        pre = tl.load(
            pre_ptr + ((b * H + i) * K1 + offs_k[:, None]) * C + offs_c[None, :], mask=km[:, None] & cm[None, :], other=0.0
        )
        x = pre.to(tl.float32) + tl.dot(read, w_c, input_precision="ieee")  # [K1P, CP]
        act = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))  # exact GELU
        corr_rank = tl.sum(act * hw_rank[None, :], axis=1) + hb_rank  # [K1P]
        corr_gate = tl.sum(act * hw_gate[None, :], axis=1) + hb_gate
        rank = tl.load(rank0_ptr + (b * H + i) * K + offs_k, mask=offs_k < K, other=0.0).to(tl.float32) + corr_rank
        alt = tl.where((offs_k >= 1) & (offs_k < K), rank, float("-inf"))
        best = tl.max(alt, axis=0)
        arg = tl.argmax(alt, axis=0)
        lse = best + tl.log(tl.sum(tl.exp(alt - best), axis=0))
        delta = tl.sum(tl.where(offs_k == K, corr_gate, 0.0), axis=0)  # δ_iK, the slot query
        if CONTRAST:  # + Σ_{k>0} r_ik δ_ik − δ_i0 (causal.combine)
            r = tl.where((offs_k >= 1) & (offs_k < K), tl.exp(alt - lse), 0.0)
            delta += tl.sum(r * corr_gate, axis=0) - tl.sum(tl.where(offs_k == 0, corr_gate, 0.0), axis=0)
        gate = tl.load(gate0_ptr + b * H + i).to(tl.float32) + delta
        pick = tl.where(gate + (best - lse) > tie_tol, arg, 0)
        tl.store(pick_ptr + b * H + i, pick.to(tl.int64))
        tl.store(gate_ptr + b * H + i, gate.to(gate_ptr.dtype.element_ty))
        tl.store(rank_ptr + (b * H + i) * K + offs_k, rank.to(rank_ptr.dtype.element_ty), mask=offs_k < K)
        row = ((b * H + i) * K + pick) * R + offs_r  # the picked candidate's memory terms
        k_new = tl.load(ck_ptr + row, mask=rm, other=0.0).to(tl.float32)
        v_new = tl.load(cv_ptr + row, mask=rm, other=0.0).to(tl.float32)
        q_term = tl.load(cq_ptr + row, mask=rm, other=0.0).to(tl.float32)


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def walk_triton(w: WalkInputs) -> WalkResult:
    """Same contract as `selectors.drelay.walk.walk`: pool_index [B, H] int64, gate [B, H],
    rank [B, H, K] in the dtype of rank0."""
    B, H, nh, K1, dg = w.query.shape
    K, C = K1 - 1, w.pre.shape[-1]
    pick = torch.empty(B, H, dtype=torch.long, device=w.query.device)
    gate = torch.empty(B, H, dtype=w.rank0.dtype, device=w.query.device)
    rank = torch.empty(B, H, K, dtype=w.rank0.dtype, device=w.query.device)
    c = [
        t.contiguous()
        for t in (
            w.query,
            w.pre,
            w.rank0,
            w.gate0,
            w.anchor_k,
            w.anchor_v,
            w.anchor_q,
            w.cand_k,
            w.cand_v,
            w.cand_q,
            w.out_w,
            w.head_w,
            w.head_b,
        )
    ]
    _walk_kernel[(B,)](
        *c,
        pick,
        gate,
        rank,
        H,
        K,
        C,
        dg**-0.5,
        TIE_TOL,
        NH=nh,
        DG=dg,
        K1P=_block(K1),
        HP=_block(H),
        RP=_block(nh * dg),
        CP=_block(C),
        CONTRAST=w.contrast,
    )
    return WalkResult(pool_index=pick, gate=gate, rank=rank)
