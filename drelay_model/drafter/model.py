"""DFlash-style block drafter (pure PyTorch).

One forward predicts a whole block. Inputs per block m with anchor position a_m:
    queries  : [E(anchor), e_mask, …, e_mask]                          S = block_size positions a_m … a_m+S-1
    context  : c = RMSNorm(W_fc · concat_l h^target_l(p))               for verified positions p < a_m
Every drafter layer attends from the block to  K = [W_k c_p (p < a_m) ; W_k x_blk],  i.e. the context is
injected as extra keys/values (strictly before the anchor) and attention inside the block is
bidirectional. Slot i ≥ 1 of the final hidden state goes through the target's frozen LM head (or a
frequency-ranked subset of its rows, the draft vocabulary) and proposes the pool: the top-K tokens.

Shapes: B batch, M blocks per row, S = block_size, H = S - 1 slots, C context positions, D width,
K pool size, V (draft) vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from drelay_model.attention import attend, attention_path, compute_dtype, prepare_mask
from drelay_model.kernels import cpu_linear
from drelay_model.drafter.config import DrafterConfig
from drelay_model.kv_cache import KVCache


@dataclass(frozen=True)
class DraftBlock:
    """One drafted block per row: the pool every selector chooses from.

    hidden     [B, H, D]  final hidden state of slots 1..H (after the final norm)
    cand_ids   [B, H, K]  int64 target-vocabulary ids, by decreasing q; [..., 0] is the native argmax
    cand_logq  [B, H, K]  float32 log q(v) under the drafter's full (draft-vocab) softmax
    """

    hidden: torch.Tensor
    cand_ids: torch.Tensor
    cand_logq: torch.Tensor


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, init: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(init.detach().clone() if init is not None else torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The weight in x's dtype: under bf16 autocast x is bf16, and a float weight would force
        # torch's unfused fallback (and a warning per call).
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)


class _Layer(nn.Module):
    """Pre-norm attention (q/k RMSNorm, RoPE) + SwiGLU MLP."""

    def __init__(self, cfg: DrafterConfig, kernels: cpu_linear.CpuKernels) -> None:
        super().__init__()
        D, hd = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        lin = partial(cpu_linear.PackedLinear, bias=False, cpu_kernels=kernels)
        self.in_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.q_proj = lin(D, cfg.num_heads * hd, few_rows_int8=True)
        self.k_proj = lin(D, cfg.num_kv_heads * hd)
        self.v_proj = lin(D, cfg.num_kv_heads * hd)
        self.o_proj = lin(cfg.num_heads * hd, D, few_rows_int8=True)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.post_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.gate_proj = lin(D, cfg.intermediate_size, few_rows_int8=True)
        self.up_proj = lin(D, cfg.intermediate_size, few_rows_int8=True)
        self.down_proj = lin(cfg.intermediate_size, D, few_rows_int8=True)

    def kv(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [B, T, D] (already normalised) → k, v [B, n_kv, T, hd] with RoPE on k."""
        B, T, _ = h.shape
        k = self.k_norm(self.k_proj(h).view(B, T, -1, self.cfg.head_dim)).transpose(1, 2)
        v = self.v_proj(h).view(B, T, -1, self.cfg.head_dim).transpose(1, 2)
        return _rope(k, cos, sin), v

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask, path: str) -> torch.Tensor:
        """x [B, Q, D] block tokens; ctx_k/v [B, n_kv, C, hd]; mask [B, 1, Q, C+Q] in `path`'s form
        (drelay_model/attention.py) or None."""
        B, Q, D = x.shape
        h = self.in_norm(x)
        q = self.q_norm(self.q_proj(h).view(B, Q, -1, self.cfg.head_dim)).transpose(1, 2)
        q = _rope(q, cos, sin)  # [B, nh, Q, hd]
        k_blk, v_blk = self.kv(h, cos, sin)
        k = torch.cat([ctx_k, k_blk], dim=2)
        v = torch.cat([ctx_v, v_blk], dim=2)
        attn = attend(q, k, v, mask, path)  # [B, nh, Q, hd]
        x = x + self.o_proj(attn.transpose(1, 2).reshape(B, Q, -1))
        h = self.post_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


def _capturing(t: torch.Tensor) -> bool:
    """True while `t`'s work is being traced (torch.compile) or captured into a CUDA graph: no host
    syncs then, so data-dependent shortcuts are skipped (their result is the same without them)."""
    return torch.compiler.is_compiling() or (t.is_cuda and torch.cuda.is_current_stream_capturing())


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, n, T, hd]; cos/sin [B, 1, T, hd]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class BlockDrafter(nn.Module):
    """Trainable block drafter bound to a frozen target's embedding and LM head.

    cpu_kernels: the CPU kernel settings its linears and head run with (default: its target's,
    `TargetModel.cpu_kernels`, else `CpuKernels.from_env()`); a selector built for it takes them too.
    """

    def __init__(
        self,
        config: DrafterConfig,
        target,
        draft_to_target: torch.Tensor | None = None,
        *,
        cpu_kernels: cpu_linear.CpuKernels | None = None,
    ) -> None:
        super().__init__()
        config.check_target(target)
        D = config.hidden_size
        self.config = config
        if cpu_kernels is None:
            cpu_kernels = getattr(target, "cpu_kernels", None) or cpu_linear.CpuKernels.from_env()
        self.cpu_kernels = cpu_kernels
        self.fc = cpu_linear.PackedLinear(len(config.target_layer_ids) * D, D, bias=False, cpu_kernels=cpu_kernels)
        self.ctx_norm = RMSNorm(D, config.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.randn(D) * 0.02)
        self.layers = nn.ModuleList(_Layer(config, cpu_kernels) for _ in range(config.num_layers))
        self.norm = RMSNorm(D, config.rms_norm_eps, init=target.final_norm_weight)
        inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        # Frozen, shared with the target; never saved in a drafter checkpoint.
        self.register_buffer("embed_weight", target.embed_weight.detach(), persistent=False)
        head = target.lm_head_weight.detach()
        if config.draft_vocab_size is not None:
            if draft_to_target is None or draft_to_target.shape != (config.draft_vocab_size,):
                raise ValueError(f"draft_to_target must be [{config.draft_vocab_size}] int64")
            head = head[draft_to_target]
            self.register_buffer("draft_to_target", draft_to_target.long().clone())
            inverse = torch.full((target.vocab_size,), -1, dtype=torch.long)
            inverse[draft_to_target] = torch.arange(config.draft_vocab_size)
            self.register_buffer("target_to_draft", inverse, persistent=False)  # -1: not draftable
        else:
            self.draft_to_target = None
            self.target_to_draft = None
        self.register_buffer("head_weight", head, persistent=False)
        self._head_pack = cpu_linear.PackCache()
        self._rank_pack = cpu_linear.PackCache(cpu_linear.RANK)  # the head in bf16 or int8, to rank the pool

    def grow(self, extra_layers: int) -> None:
        """Append `extra_layers` layers that start as the identity: o_proj = down_proj = 0, so each
        new layer returns its input (x + 0 + 0) and the grown drafter drafts exactly as before. The
        other weights keep their fresh initialisation; they get gradients once o_proj moves off zero
        (zero-initialised residual branches, as in depth growth of pre-norm transformers)."""
        if extra_layers < 1:
            raise ValueError(f"extra_layers must be ≥ 1, got {extra_layers}")
        for _ in range(extra_layers):
            layer = _Layer(self.config, self.cpu_kernels).to(self.fc.weight)  # its device and dtype
            with torch.no_grad():
                layer.o_proj.weight.zero_()
                layer.down_proj.weight.zero_()
            self.layers.append(layer)
        self.config = replace(self.config, num_layers=len(self.layers))
        for layer in self.layers:  # every layer reads its shapes from the drafter's config
            layer.cfg = self.config

    # ---- context -------------------------------------------------------------------------------
    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] → cos, sin [B, 1, T, hd]."""
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]
        return emb.cos().to(self.fc.weight.dtype), emb.sin().to(self.fc.weight.dtype)

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer context keys/values. features [B, C, L*D_target], positions [B, C] →
        one (k, v) pair [B, n_kv, C, hd] per drafter layer:
            c = ctx_norm(W_fc f)                                    [B, C, D]
            layer l reads in_norm_l(c)  (config.context_layer_norm)  or c itself (DFlash's layout)."""
        c = self.ctx_norm(self.fc(features.to(self.fc.weight.dtype)))
        cos, sin = self._cos_sin(positions)
        per_layer = self.config.context_layer_norm
        return [layer.kv(layer.in_norm(c) if per_layer else c, cos, sin) for layer in self.layers]

    def new_context_cache(self, batch_size: int, capacity: int) -> KVCache:
        cfg = self.config
        return KVCache(
            n_layers=cfg.num_layers,
            batch_size=batch_size,
            n_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            capacity=capacity,
            dtype=self.fc.weight.dtype,
            device=self.fc.weight.device,
        )

    def extend_context(self, features: torch.Tensor, cache: KVCache) -> None:
        """Append target features [B, T, L*D] at positions cache.lengths + t (crop afterwards)."""
        positions, _ = cache.begin(features.shape[1])
        for i, (k, v) in enumerate(self.context_kv(features, positions)):
            cache.append(i, k, v)
        cache.end()

    def forward(
        self, anchor_ids: torch.Tensor, anchor_pos: torch.Tensor, features: torch.Tensor, block_len: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Training entry point (what DDP wraps): blocks at anchors [B, M] from the features
        [B, N, L*D] of whole sequences (block m sees positions < anchor_pos[b, m]) → [B, M, S, D];
        `block_len` [B, M] drafts block m as a partial block of block_len slots (`block_hidden`)."""
        B, N, _ = features.shape
        positions = torch.arange(N, device=features.device)[None].expand(B, N)
        return self.block_hidden(anchor_ids, anchor_pos, self.context_kv(features, positions), block_len=block_len)

    # ---- blocks --------------------------------------------------------------------------------
    def block_hidden(
        self,
        anchor_ids: torch.Tensor,
        anchor_pos: torch.Tensor,
        ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],
        size: int | None = None,
        block_len: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states of M blocks per row.

        Args:
            anchor_ids  [B, M] int64 anchor tokens; anchor_pos [B, M] their absolute positions.
            ctx_kv      per layer (k, v) [B, n_kv, C, hd] for context positions 0..C-1; block m sees
                        context position p only if p < anchor_pos[b, m] (strict).
            size        positions per block, S (default: block_size, as trained); fewer drafts
                        only the first size − 1 slots (inference: `draft`).
            block_len   [B, M] int64 in 1..S−1, or None: block m's positions past slot block_len
                        are hidden from every query, so its first block_len slots are what a
                        partial block of block_len slots drafts (`draft(slots=…)`; training on
                        the partial blocks cost-aware rounds draft). Its later slots are not.
        Returns:
            [B, M, S, D] after the final norm (slot 0 is the anchor).
        """
        B, M = anchor_ids.shape
        S, D = size or self.config.block_size, self.config.hidden_size
        C = ctx_kv[0][0].shape[2]
        x = self.mask_embedding.expand(B, M, S, D).clone()
        x[:, :, 0] = F.embedding(anchor_ids, self.embed_weight).to(x.dtype)
        x = x.view(B, M * S, D)
        positions = (anchor_pos[:, :, None] + torch.arange(S, device=anchor_pos.device)).view(B, M * S)
        cos, sin = self._cos_sin(positions)
        path = attention_path(x.device)  # one fused kernel per device, the same for every layer
        mask = prepare_mask(self._block_mask(anchor_pos, C, S, block_len), path, compute_dtype(x))
        for layer, (ck, cv) in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, ck, cv, mask, path)
        return self.norm(x).view(B, M, S, D)

    def _block_mask(self, anchor_pos: torch.Tensor, C: int, S: int, block_len: torch.Tensor | None = None) -> torch.Tensor | None:
        """[B, 1, M*S, C + M*S] bool: context p < anchor of the query's block; own block only (and,
        with block_len [B, M], only its positions 0..block_len)."""
        B, M = anchor_pos.shape
        if block_len is None and M == 1 and not _capturing(anchor_pos) and bool((anchor_pos == C).all()):
            return None  # single block that sees the whole context: no mask needed (a host sync)
        ctx_ok = torch.arange(C, device=anchor_pos.device)[None, None, :] < anchor_pos[:, :, None]  # [B, M, C]
        ctx_ok = ctx_ok[:, :, None, :].expand(B, M, S, C).reshape(B, M * S, C)
        blk = torch.arange(M, device=anchor_pos.device).repeat_interleave(S)  # [M*S] block index
        blk_ok = (blk[:, None] == blk[None, :]).expand(B, M * S, M * S)
        if block_len is not None:  # key j of block m is seen only while j ≤ block_len[b, m]
            j = torch.arange(S, device=anchor_pos.device).repeat(M)  # [M*S] position within its block
            blk_ok = blk_ok & (j[None, :] <= block_len.repeat_interleave(S, dim=1))[:, None, :]  # [B, M*S, M*S]
        return torch.cat([ctx_ok, blk_ok], dim=-1)[:, None]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., D] → [..., V_draft] float32 logits through the frozen (draft-vocab) head (pre-packed
        for oneDNN at inference on CPU in float32: kernels/cpu_linear.py)."""
        w = self.head_weight
        if hidden.dtype != w.dtype:
            return F.linear(hidden, w.to(hidden.dtype)).float()
        return cpu_linear.linear(hidden, w, None, self._head_pack.get(w, self.cpu_kernels)).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.draft_to_target is None else self.draft_to_target[draft_ids]

    # ---- inference -----------------------------------------------------------------------------
    @torch.inference_mode()
    def draft(self, anchor_ids: torch.Tensor, ctx_cache: KVCache, *, slots: int | None = None) -> DraftBlock:
        """Draft one block per row after the verified context in `ctx_cache`.

        anchor_ids [B] int64, the last verified token of each row, at position ctx_cache.lengths[b].
        slots: draft only the first `slots` slots (default: all H): the block is the anchor and
        `slots` masked positions, and only those get an LM head. Attention inside a block is
        bidirectional, so a shorter block is a slightly different estimate of the same slots
        (never a different output: verification decides); on the bundled checkpoint it accepts as
        often (docs/benchmarks.md) and costs a fraction of the whole block.
        """
        anchor_pos = ctx_cache.lengths[:, None]  # [B, 1]
        C = int(anchor_pos.max())
        ctx_kv = [(ctx_cache.k[i, :, :, :C], ctx_cache.v[i, :, :, :C]) for i in range(self.config.num_layers)]
        size = self.config.block_size if slots is None else 1 + min(max(slots, 1), self.config.num_slots)
        hidden = self.block_hidden(anchor_ids[:, None], anchor_pos, ctx_kv, size=size)[:, 0, 1:]  # [B, size − 1, D]
        return self.pool(hidden)

    def pool(self, hidden: torch.Tensor) -> DraftBlock:
        """Slot hidden states [B, H, D] → the top-K pool under the drafter's softmax.

        Where its settings and the CPU allow (`CpuKernels.rank_dtype`: bfloat16 where native, else
        int8 weights, for at most `INT8_MAX_ROWS` rows), the head is read once in that precision to rank the draft
        vocabulary, and only the K members get float32 logits:
            members  = top-K of the coarse logits                                 [B, H, K]
            z_v      = h · w_v in float32 for members, the coarse logit otherwise
            log q_v  = z_v − logsumexp(z)
        so the pool's order and log q are float32 up to the coarse part of the normaliser, and a
        pool can differ from the float32 one only in a member tied at the K-th place.
        """
        K = self.config.top_k
        w = self.head_weight
        coarse = None
        if hidden.dtype == w.dtype == torch.float32:
            packed = self._rank_pack.get(w, self.cpu_kernels)  # None under autograd or where no coarse precision runs
            if cpu_linear.ranks_faster(packed, hidden[..., 0].numel()):
                coarse = cpu_linear.linear(hidden, w, None, packed)  # [B, H, V] bf16 logits, as float32
        if coarse is None:
            logq = torch.log_softmax(self.logits(hidden), dim=-1)  # [B, H, V]
            cand_logq, cand = logq.topk(K, dim=-1)  # [B, H, K]
        else:
            cand = coarse.topk(K, dim=-1).indices  # [B, H, K]
            exact = (w[cand] @ hidden[..., None])[..., 0]  # [B, H, K] float32 member logits
            exact, order = exact.sort(dim=-1, descending=True)
            cand = cand.gather(-1, order)
            z = coarse.scatter_(-1, cand, exact)  # [B, H, V]
            cand_logq = exact - torch.logsumexp(z, dim=-1, keepdim=True)
        return DraftBlock(hidden=hidden, cand_ids=self.to_target_ids(cand), cand_logq=cand_logq)
