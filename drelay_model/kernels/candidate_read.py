"""Global Read's candidate attention (Eq. 1) as one Triton kernel.

For query (i, k) and key (j, l) of one row and head, with T = H·K keys:
    s = (W_Q n_ik)·(W_K n_jl) / √d_g + log q_j(v_jl) + b_h[j − i]     (−∞ where key_mask is False)
    out_ik = Σ_jl exp(s − m) W_V n_jl / (exp(−m) + Σ_jl exp(s − m)),   m = max(0, max_jl s)
the exp(−m) term being the zero null key (logit 0, value 0). Same math as
`GlobalRead.candidate_read` → `null_attention`; computed in float32, stored in the input dtype.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _candidate_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    logq_ptr,
    rel_ptr,
    mask_ptr,
    out_ptr,
    NH,
    T,
    H,
    K,
    DG,
    scale,
    HAS_MASK: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_bh, pid_q = tl.program_id(0), tl.program_id(1)
    b, h = pid_bh // NH, pid_bh % NH
    offs_q = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_t = tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    qm, tm, dm = offs_q < T, offs_t < T, offs_d < DG
    base = pid_bh * T * DG  # q, k, v contiguous [B, nh, T, d_g]
    q = tl.load(q_ptr + base + offs_q[:, None] * DG + offs_d[None, :], mask=qm[:, None] & dm[None, :], other=0.0).to(tl.float32)
    k = tl.load(k_ptr + base + offs_t[:, None] * DG + offs_d[None, :], mask=tm[:, None] & dm[None, :], other=0.0).to(tl.float32)
    v = tl.load(v_ptr + base + offs_t[:, None] * DG + offs_d[None, :], mask=tm[:, None] & dm[None, :], other=0.0).to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_Q, BLOCK_T]
    prior = tl.load(logq_ptr + b * T + offs_t, mask=tm, other=0.0).to(tl.float32)  # log q_j(v_jl)
    rel_idx = offs_t[None, :] // K - offs_q[:, None] // K + H - 1  # j − i + H − 1
    rel = tl.load(rel_ptr + h * (2 * H - 1) + rel_idx, mask=qm[:, None] & tm[None, :], other=0.0).to(tl.float32)
    s = s + prior[None, :] + rel
    valid = tm
    if HAS_MASK:
        valid = valid & (tl.load(mask_ptr + b * T + offs_t, mask=tm, other=0) != 0)
    s = tl.where(valid[None, :], s, float("-inf"))
    m = tl.maximum(tl.max(s, axis=1), 0.0)  # the null key's logit is 0
    p = tl.exp(s - m[:, None])
    denom = tl.sum(p, axis=1) + tl.exp(-m)
    out = tl.dot(p, v, input_precision="ieee") / denom[:, None]
    out_ptrs = out_ptr + base + offs_q[:, None] * DG + offs_d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=qm[:, None] & dm[None, :])


def _block(n: int) -> int:
    """Tile width: a power of two, at least 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(n))


def candidate_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cand_logq: torch.Tensor,
    rel_bias: torch.Tensor,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Args:
        q, k, v    [B, nh, T, d_g] with T = H·K, keys/queries ordered (slot, candidate).
        cand_logq  [B, H, K] draft log-probabilities (the prior of key (j, l)).
        rel_bias   [nh, 2H − 1] b_h[j − i + H − 1].
        key_mask   [B, T] bool (True = usable evidence) or None.
    Returns:
        [B, nh, T, d_g] in q's dtype.
    """
    B, nh, T, dg = q.shape
    H, K = cand_logq.shape[1:]
    assert T == H * K and k.shape == v.shape == q.shape and rel_bias.shape == (nh, 2 * H - 1)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q)
    mask = key_mask.reshape(B, T).to(torch.int8).contiguous() if key_mask is not None else cand_logq
    block_q = 16
    grid = (B * nh, triton.cdiv(T, block_q))
    _candidate_attention_kernel[grid](
        q,
        k,
        v,
        cand_logq.contiguous(),
        rel_bias.contiguous(),
        mask,
        out,
        nh,
        T,
        H,
        K,
        dg,
        1.0 / math.sqrt(dg),
        HAS_MASK=key_mask is not None,
        BLOCK_Q=block_q,
        BLOCK_T=_block(T),
        BLOCK_D=_block(dg),
    )
    return out
