"""Our drafter's forward as SGLang's DFLASH runner runs it: flat token tensors, pure PyTorch.

SGLang's draft runner never sees [B, M, S, D] blocks. It sees
  - context materialisation (`DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc`): verified
    target features f [T, L·D] at positions p [T]; per draft layer the worker calls
        c   = model.project_target_hidden(f)                      [T, D]
        c_l = model.prepare_context_hidden_for_kv(layer, c)       [T, D]
        k, v = layer.self_attn.kv_proj_only(c_l)                  [T, n_kv·hd] each
        k   = layer.self_attn.apply_k_rope(p, layer.self_attn.apply_k_norm(k))
    and writes k, v [T, n_kv, hd] into the layer's paged KV at the tokens' cache slots;
  - the draft block forward `model.forward(input_ids [N], positions [N], forward_batch,
    input_embeds [N, D])`, N = bs·S dense blocks (slot 0 = anchor, slots 1..H = mask tokens),
    whose attention (RadixAttention, non-causal) reads each row's context from the paged KV plus
    the row's own S block tokens, and returns the final hidden states [N, D].
This module holds that math with parameters under the exported names (model.py), so an export's
safetensors load as they are. Our three differences from SGLang's DFlashDraftModel live here:
  (a) context K/V apply each layer's input RMSNorm to the projected features:
      k_p = RoPE(RMSNorm_k(W_k RMSNorm_in(RMSNorm_ctx(W_fc f_p))))   (`prepare_context_hidden_for_kv`);
  (b) the masked slots start from the learned vector `mask_embedding` [D] whatever the worker's
      mask-token embedding was (`block_inputs`);
  (c) the pool is the top-K of log-softmax over the draft vocabulary (the target head's rows
      `d2t`), mapped back to target ids (`candidates`).
The attention kernel is a parameter (`attend`): RadixAttention in SGLang (runner.py), and
`reference_block_attention` here, on CPU, for the tests. Tensor parallelism: none (TP = 1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from drelay_model.drafter import DrafterConfig
from drelay_model.drafter.model import RMSNorm
from drelay_model.errors import DRelayError

# attend(q [N, nh·hd], k [N, n_kv·hd], v [N, n_kv·hd]) → [N, nh·hd] for one layer's block tokens.
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Vector(nn.Module):
    """One learned vector under `<name>.weight` (the exported `mask_embedding.weight` [D])."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Neox-style RoPE as our drafter applies it. x [T, n, hd], positions [T] → [T, n, hd]
    (angles in float32, cos/sin then cast to x's dtype)."""
    freqs = positions[:, None].float() * inv_freq  # [T, hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [T, 1, hd]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class DraftAttention(nn.Module):
    """`layers.N.self_attn`: q/k/v/o projections, per-head q/k RMSNorm, RoPE. `attn` is the
    layer's RadixAttention once runner.py attaches it (SGLang writes the KV pool through it)."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        D, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.q_proj = nn.Linear(D, cfg.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(D, cfg.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(D, cfg.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * hd, D, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2).float() / hd)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [hd/2] float32
        self.attn = None

    # ---- the three calls the DFLASH worker makes to materialise context K/V -------------------
    def kv_proj_only(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, D] (already input-normed) → k, v [T, n_kv·hd]."""
        return self.k_proj(h), self.v_proj(h)

    def apply_k_norm(self, k: torch.Tensor) -> torch.Tensor:
        """Per-head RMSNorm. k [T, n_kv·hd] → same shape."""
        return self.k_norm(k.view(k.shape[0], -1, self.head_dim)).view_as(k)

    def apply_k_rope(self, positions: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """k [T, n_kv·hd], positions [T] → same shape."""
        return rope(k.view(k.shape[0], -1, self.head_dim), positions, self.inv_freq).reshape(k.shape)

    # ---- block tokens ---------------------------------------------------------------------------
    def forward(self, positions: torch.Tensor, h: torch.Tensor, attend: Attend) -> torch.Tensor:
        """h [N, D] input-normed block tokens at positions [N] → o_proj(attention) [N, D]."""
        N = h.shape[0]
        q = self.q_norm(self.q_proj(h).view(N, -1, self.head_dim))
        q = rope(q, positions, self.inv_freq).reshape(N, -1)  # [N, nh·hd]
        k, v = self.kv_proj_only(h)
        k = self.apply_k_rope(positions, self.apply_k_norm(k))
        return self.o_proj(attend(q, k, v))


class DraftMLP(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class DraftLayer(nn.Module):
    """`layers.N`: pre-norm attention + SwiGLU MLP (residuals outside the norms, as we train)."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, attend: Attend) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class DraftRunner(nn.Module):
    """The exported drafter in SGLang-runner form (parameters = the export's names)."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        D = cfg.hidden_size
        self.drafter_config = cfg
        self.block_size = cfg.block_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * D, D, bias=False)
        self.hidden_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.mask_embedding = Vector(D)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        if cfg.draft_vocab_size is not None:
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        else:
            self.d2t = None
        self.extra_tensors: dict[str, torch.Tensor] = {}  # drelay_selector.* (the trained selector)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy (exported name, tensor) pairs into the parameters; `drelay_selector.*` are kept
        aside. Every parameter must be given; unknown names are an error (one line)."""
        own = {**dict(self.named_parameters()), **({"d2t": self.d2t} if self.d2t is not None else {})}
        loaded: set[str] = set()
        with torch.no_grad():
            for name, tensor in weights:
                if name.startswith("drelay_selector."):
                    self.extra_tensors[name] = tensor
                elif name in own:
                    if tuple(tensor.shape) != tuple(own[name].shape):
                        raise DRelayError(
                            f"exported tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(own[name].shape)}"
                        )
                    own[name].copy_(tensor)
                else:
                    raise DRelayError(f"exported tensor {name} is not part of this drafter")
                loaded.add(name)
        missing = sorted(set(own) - loaded)
        if missing:
            raise DRelayError(f"exported checkpoint is missing drafter tensors: {', '.join(missing[:5])}")
        return loaded

    def set_block_size(self, block_size: int) -> None:
        """The worker's resolved S (`--speculative-num-draft-tokens`); at most the trained one."""
        if not 2 <= int(block_size) <= self.drafter_config.block_size:
            raise ValueError(
                f"DRELAY block size {block_size} must be in [2, {self.drafter_config.block_size}] (the drafter's trained block)"
            )
        self.block_size = int(block_size)

    # ---- context: the worker's materialisation hooks -------------------------------------------
    def project_target_hidden(self, features: torch.Tensor) -> torch.Tensor:
        """f [T, L·D] → c = RMSNorm_ctx(W_fc f) [T, D]."""
        if features.ndim != 2 or features.shape[-1] != self.fc.in_features:
            raise ValueError(f"DRELAY target features must be [T, {self.fc.in_features}], got {tuple(features.shape)}")
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def prepare_context_hidden_for_kv(self, layer: DraftLayer, c: torch.Tensor) -> torch.Tensor:
        """Difference (a): the layer's input RMSNorm on the projected features (none for a drafter in
        DFlash's layout, `context_layer_norm: false`). [T, D] → [T, D]."""
        return layer.input_layernorm(c) if self.drafter_config.context_layer_norm else c

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """What the worker writes into each layer's draft KV for features [T, L·D] at positions
        [T], computed through the same calls it makes: one (k, v) [T, n_kv, hd] per layer."""
        c = self.project_target_hidden(features)
        out = []
        for layer in self.layers:
            attn = layer.self_attn
            k, v = attn.kv_proj_only(self.prepare_context_hidden_for_kv(layer, c))
            k = attn.apply_k_rope(positions, attn.apply_k_norm(k))
            out.append((k.view(-1, attn.num_kv_heads, attn.head_dim), v.view(-1, attn.num_kv_heads, attn.head_dim)))
        return out

    # ---- the draft block -----------------------------------------------------------------------
    def block_inputs(self, input_embeds: torch.Tensor) -> torch.Tensor:
        """Difference (b). input_embeds [N, D], N = bs·S dense blocks → x [N, D]: slot 0 keeps the
        anchor's embedding, slots 1..S-1 take `mask_embedding`."""
        N, S = input_embeds.shape[0], self.block_size
        if N % S:
            raise ValueError(f"DRELAY draft forward expects dense blocks of {S} tokens, got {N} tokens")
        w = self.mask_embedding.weight
        is_mask = (torch.arange(N, device=input_embeds.device) % S != 0)[:, None]  # [N, 1]
        return torch.where(is_mask, w[None, :], input_embeds.to(w.dtype))

    def block_hidden(self, input_embeds: torch.Tensor, positions: torch.Tensor, attends: list[Attend]) -> torch.Tensor:
        """Final hidden states [N, D] of the blocks (input_embeds [N, D], positions [N]);
        attends[i] is layer i's attention (reads the context KV + the block's own K/V)."""
        x = self.block_inputs(input_embeds)
        for layer, attend in zip(self.layers, attends):
            x = layer(positions, x, attend)
        return self.norm(x)

    # ---- the pool ------------------------------------------------------------------------------
    def draft_head(self, target_head_weight: torch.Tensor) -> torch.Tensor:
        """The draft head [V_draft, D] from the target LM head's weight [≥ V, D] (rows d2t, or
        the first V rows: SGLang pads the head past the vocabulary)."""
        V = self.drafter_config.target.vocab_size if self.drafter_config.target is not None else target_head_weight.shape[0]
        return target_head_weight[self.d2t] if self.d2t is not None else target_head_weight[:V]

    def candidates(self, hidden: torch.Tensor, head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Difference (c). hidden [N, D], head [V_draft, D] → (target ids [N, K] int64,
        log q [N, K] float32 under the full draft-vocabulary softmax), by decreasing q. `head` must
        already be in hidden's dtype (built once, runner.py): casting here would copy V_draft × D
        values on every call."""
        if head.dtype != hidden.dtype:
            raise DRelayError(f"draft head dtype {head.dtype} differs from the hidden states' {hidden.dtype}")
        logits = F.linear(hidden, head)  # [N, V_draft] in the drafter's dtype
        top, cand = logits.topk(self.drafter_config.top_k, dim=-1)  # log-softmax is monotone: the same pool
        cand_logq = top.float() - chunked_logsumexp(logits)[:, None]  # [N, K] log q = z − log Σ exp z
        return (cand if self.d2t is None else self.d2t[cand]), cand_logq


LSE_CHUNK = 16384  # vocabulary columns per float32 chunk: N × 16,384 × 4 B (48 MB at N = 768)


def chunked_logsumexp(logits: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """log Σ_v exp z_v per row in float32, z [N, V] in any dtype → [N] float32, reading V in
    fixed chunks: the float32 working set is N × chunk, never N × V (the draft step runs in a
    captured graph every round; a full-vocabulary float32 log-softmax there costs 8·N·V bytes).
    m = max_v z_v; lse = m + log Σ_chunks Σ_v exp(z_v − m). Static shapes, no host syncs."""
    chunk = chunk or LSE_CHUNK
    m = logits.amax(dim=-1).float()  # [N]
    total = torch.zeros_like(m)
    for start in range(0, logits.shape[-1], chunk):
        total += (logits[:, start : start + chunk].float() - m[:, None]).exp().sum(dim=-1)
    return m + total.log()


def reference_block_attention(
    ctx_k: torch.Tensor, ctx_v: torch.Tensor, ctx_lens: torch.Tensor, *, block_size: int, num_heads: int, head_dim: int
) -> Attend:
    """What RadixAttention computes for the draft block (non-causal), on plain tensors.

    ctx_k/ctx_v [bs, C, n_kv, hd]: each row's materialised context (row b's first ctx_lens[b]
    entries are valid). The returned attend(q, k, v) takes the block tokens q [bs·S, nh·hd],
    k/v [bs·S, n_kv·hd]; block token i of row b attends context 0..ctx_lens[b]-1 and all S tokens
    of its own block. Rows are looped (a reference, not a kernel).
    """

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        S, n_kv = block_size, ctx_k.shape[2]
        out = []
        for b in range(ctx_k.shape[0]):
            n = int(ctx_lens[b])
            rows = slice(b * S, (b + 1) * S)
            kb = torch.cat([ctx_k[b, :n], k[rows].view(S, n_kv, head_dim)]).transpose(0, 1)  # [n_kv, n+S, hd]
            vb = torch.cat([ctx_v[b, :n], v[rows].view(S, n_kv, head_dim)]).transpose(0, 1)
            qb = q[rows].view(S, num_heads, head_dim).transpose(0, 1)  # [nh, S, hd]
            o = F.scaled_dot_product_attention(qb[None], kb[None], vb[None], enable_gqa=num_heads != n_kv)
            out.append(o[0].transpose(0, 1).reshape(S, -1))
        return torch.cat(out)

    return attend
