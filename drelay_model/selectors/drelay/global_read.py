"""Global Read (§4.2): compare every candidate with the whole predicted block.

Two resolutions, both computed once per drafted block from draft-side tensors only (slot hidden
states and the candidate distributions; never a teacher or an unverified target token):

  slot mixing      x_i = s_i + W_m Σ_k π_ik ê_ik,   π_ik = q_i(v_ik) / Σ_l q_i(v_il)
                   u = LN(Block_2(Block_1(x)))       bidirectional attention–FFN blocks over slots
  candidate reads  n_ik = LN(u_i + W_n ê_ik)
                   G_ik = W_O Σ_{j,l} A_ik,jl W_V n_jl                                      (Eq. 1)
                   A_ik,jl ∝ exp((W_Q n_ik)ᵀ W_K n_jl / √d_g + log q_j(v_jl) + b_{j−i}),
                   normalised jointly with a zero-valued null key/value (a content-free read)
  fusion           z_i = s_i + λ_i W_u u_i,   c_ik = ê_ik + λ_i G_ik    (λ_i: learned slot scalar)

Here s_i is the local slot feature (a projection of the drafter's hidden state h_i) and ê_ik the
projected frozen target embedding of candidate k of slot i. Shapes: B rows, H slots, K candidates,
d = d_sel, nh heads of width d_g = read_dim / nh.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from drelay_model.kernels.cpu_linear import PackedLinear
from drelay_model.selectors.drelay.config import DRelayConfig


def null_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
    null_key: bool = True,
) -> torch.Tensor:
    """Softmax attention normalised jointly with a zero-valued null key/value.

        out_q = Σ_t a_tq v_t,   a_tq = exp(s_tq) / (exp(0) + Σ_t' exp(s_t'q)),
        s_tq  = k_t·q / √d_h + bias_tq   (−∞ where key_mask is False)

    The null key has logit q·0 = 0 and value 0, so a query may read nothing: when every key is
    masked its output is exactly zero. `null_key=False` gives plain softmax attention (then at
    least one key per query must be visible). Scores are laid out key-major [.., T, Q]: the
    softmax then reduces over dim −2, which CPU kernels vectorise even for short key sets.

    Args:
        q         [B, nh, Q, dh]; k, v [B, nh, T, dh].
        bias      additive logits broadcastable to [B, nh, T, Q] (keys first), or None.
        key_mask  [B, T] bool, True = a real key; None = all real.
    Returns:
        [B, nh, Q, dh], the dtype of v.
    """
    scores = k @ q.transpose(-1, -2) * (1.0 / math.sqrt(q.shape[-1]))  # [B, nh, T, Q]
    if bias is not None:
        scores = scores + bias
    if key_mask is not None:
        scores = scores.masked_fill(key_mask[:, None, :, None].logical_not(), float("-inf"))
    if null_key:  # logit of the zero key; its value is zero, so its weight is dropped after the softmax
        scores = torch.cat([scores, scores.new_zeros(scores.shape[:-2] + (1, scores.shape[-1]))], dim=-2)
    attn = torch.softmax(scores, dim=-2)[..., : k.shape[-2], :]  # [B, nh, T, Q]
    return attn.transpose(-1, -2) @ v


def fused_null_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, bias: torch.Tensor | None = None, key_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """`null_attention` in one fused kernel (`F.scaled_dot_product_attention`), for inference.

    The null key joins as one more key and value row of zeros: its logit is q·0 + 0 = 0 and its
    value 0, exactly the joint normalisation above. One difference of layout: `bias` here is
    query-major, broadcastable to [B, nh, Q, T], as SDPA takes it. Scores, bias add, mask, softmax
    and the value sum then run in one pass instead of five [B, nh, T, Q] tensors (the candidate
    read's 240 × 240 scores per head cost 1.3 ms that way on the CPU default, 0.6 ms fused).
    Not for training: SDPA does not return a gradient for the additive mask, which carries the
    learned relative bias.

    Args: q [B, nh, Q, dh]; k, v [B, nh, T, dh]; key_mask [B, T] bool (True = a real key) or None.
    Returns: [B, nh, Q, dh].
    """
    B, nh, Q, dh = q.shape
    T = k.shape[2]
    k, v = F.pad(k, (0, 0, 0, 1)), F.pad(v, (0, 0, 0, 1))  # + the null key/value row of zeros
    mask = q.new_zeros(B, 1, 1, T + 1) if bias is None else F.pad(bias.expand(B, -1, Q, T), (0, 1))  # its logit: 0
    if key_mask is not None:
        real = F.pad(key_mask, (0, 1), value=True)  # the null key is always there
        mask = mask.masked_fill(real[:, None, None, :].logical_not(), float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype))


def null_read(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, bias: torch.Tensor | None = None, key_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Attention jointly normalised with a null key, `bias` query-major ([.., Q, T]): the fused
    kernel at inference, `null_attention` under autograd (SDPA gives no gradient for the additive
    mask that carries learned biases). Same math either way."""
    if torch.is_grad_enabled():
        return null_attention(q, k, v, bias=None if bias is None else bias.transpose(-1, -2), key_mask=key_mask)
    return fused_null_attention(q, k, v, bias=bias, key_mask=key_mask)


class MixBlock(nn.Module):
    """Pre-LN bidirectional self-attention + GELU FFN over the H slots of one block."""

    def __init__(self, cfg: DRelayConfig) -> None:
        super().__init__()
        d = cfg.d_sel
        self.heads = cfg.heads
        self.attn_norm = nn.LayerNorm(d, eps=cfg.ln_eps)
        self.qkv = PackedLinear(d, 3 * d, bias=False)
        self.attn_out = PackedLinear(d, d, bias=False)
        self.ffn_norm = nn.LayerNorm(d, eps=cfg.ln_eps)
        self.ffn_in = PackedLinear(d, cfg.ffn_mult * d)
        self.ffn_out = PackedLinear(cfg.ffn_mult * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, H, d] → [B, H, d]."""
        B, H, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(B, H, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v)  # [B, nh, H, dh], no mask: bidirectional
        x = x + self.attn_out(attn.transpose(1, 2).reshape(B, H, d))
        return x + self.ffn_out(F.gelu(self.ffn_in(self.ffn_norm(x))))


@dataclass(frozen=True)
class GlobalFeatures:
    """What Global Read hands to the causal selector.

    z     [B, H, d]     fused global slot features  s_i + λ_i W_u u_i
    c     [B, H, K, d]  fused candidate features    ê_ik + λ_i G_ik
    read  [B, H, K, d]  the candidate reads G_ik alone (Eq. 1), for inspection
    """

    z: torch.Tensor
    c: torch.Tensor
    read: torch.Tensor


class GlobalRead(nn.Module):
    """Slot mixing + candidate-specific reads + slotwise fusion (see the module docstring)."""

    def __init__(self, cfg: DRelayConfig, *, num_slots: int, top_k: int) -> None:
        super().__init__()
        d, r, H = cfg.d_sel, cfg.read_dim, num_slots
        self.heads, self.kernels = cfg.heads, cfg.kernels
        self.mix_in = PackedLinear(d, d, bias=False)  # W_m on the soft candidate summary
        self.blocks = nn.ModuleList(MixBlock(cfg) for _ in range(cfg.global_blocks))
        self.u_norm = nn.LayerNorm(d, eps=cfg.ln_eps)
        self.n_proj = PackedLinear(d, d, bias=False)  # W_n
        self.n_norm = nn.LayerNorm(d, eps=cfg.ln_eps)
        self.read_qkv = PackedLinear(d, 3 * r, bias=False)  # W_Q, W_K, W_V (nh heads of width d_g = r / nh)
        self.read_out = PackedLinear(r, d, bias=False)  # W_O (no bias: a content-free read stays zero)
        self.rel_bias = nn.Parameter(torch.zeros(cfg.heads, 2 * H - 1))  # b_{j−i}, j − i ∈ [1−H, H−1]
        self.slot_out = PackedLinear(d, d, bias=False)  # W_u: global slot residual
        self.fusion = nn.Parameter(torch.ones(H))  # λ_i
        slot = torch.arange(H)
        self.register_buffer("rel_index", slot[:, None] - slot[None, :] + H - 1, persistent=False)  # [H(j), H(i)]: j − i + H − 1

    def forward(
        self,
        s: torch.Tensor,
        cand_emb: torch.Tensor,
        cand_logq: torch.Tensor,
        key_mask: torch.Tensor | None = None,
    ) -> GlobalFeatures:
        """Args:
            s          [B, H, d] local slot features (from the drafter's hidden states).
            cand_emb   [B, H, K, d] projected frozen embeddings ê_ik of the pool.
            cand_logq  [B, H, K] log q_i(v_ik) under the drafter's full softmax.
            key_mask   [B, H, K] bool, candidates that may serve as evidence (None = all).
        Returns:
            GlobalFeatures (z [B, H, d], c [B, H, K, d], read [B, H, K, d]), the dtype of s.
        """
        pi = torch.softmax(cand_logq, dim=-1).to(cand_emb.dtype)  # [B, H, K] q renormalised over the pool
        summary = (pi.unsqueeze(-2) @ cand_emb).squeeze(-2)  # [B, H, d] Σ_k π_ik ê_ik
        x = s + self.mix_in(summary)
        for block in self.blocks:
            x = block(x)
        u = self.u_norm(x)  # [B, H, d] shared interpretation u_i of the block
        n = self.n_norm(u.unsqueeze(2) + self.n_proj(cand_emb))  # [B, H, K, d]
        read = self.candidate_read(n, cand_logq, key_mask)  # [B, H, K, d]
        lam = self.fusion[: s.shape[1], None]  # [H, 1]
        z = s + lam * self.slot_out(u)
        c = cand_emb + lam[..., None] * read
        return GlobalFeatures(z=z, c=c, read=read)

    def candidate_read(self, n: torch.Tensor, cand_logq: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        """Eq. 1: queries from every (i, k), keys/values from every (j, l), prior log q_j(v_jl) and
        relative bias b_{j−i}, joint normalisation with the null key. n [B, H, K, d] → [B, H, K, d]."""
        B, H, K, d = n.shape
        nh, r = self.heads, self.read_out.in_features
        q, k, v = self.read_qkv(n).view(B, H * K, 3, nh, r // nh).permute(2, 0, 3, 1, 4)  # [B, nh, HK, dg]
        if self.kernels == "triton":  # the same attention fused in one kernel (imported lazily)
            from drelay_model.kernels.candidate_read import candidate_attention

            out = candidate_attention(q, k, v, cand_logq.to(n.dtype), self.rel_bias_for(H), key_mask)
        else:
            out = self.attend(q, k, v, cand_logq, key_mask)
        return self.read_out(out.transpose(1, 2).reshape(B, H, K, r))

    def rel_bias_for(self, H: int) -> torch.Tensor:
        """b_{j−i} for a block of H ≤ num_slots slots → [nh, 2H − 1] (offset j − i + H − 1)."""
        full = (self.rel_bias.shape[1] + 1) // 2
        return self.rel_bias[:, full - H : full + H - 1]

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cand_logq: torch.Tensor, key_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """The PyTorch reference of Eq. 1's attention. q, k, v [B, nh, HK, d_g]; cand_logq [B, H, K];
        key_mask [B, H, K] bool or None → [B, nh, HK, d_g]."""
        B, nh, HK, _ = q.shape
        H, K = cand_logq.shape[1:]
        # Query-major bias [B, nh, (i, k), (j, l)]: the prior log q_j(v_jl) plus b_{j−i}.
        prior = cand_logq.reshape(B, 1, 1, 1, H, K).to(q.dtype)
        rel = self.rel_bias[:, self.rel_index[:H, :H].T][None, :, :, None, :, None].to(q.dtype)  # [1, nh, H(i), 1, H(j), 1]
        bias = (prior + rel).expand(B, nh, H, K, H, K).reshape(B, nh, HK, HK)
        mask = key_mask.reshape(B, H * K) if key_mask is not None else None
        return null_read(q, k, v, bias=bias, key_mask=mask)  # [B, nh, HK, dg]
