"""The frozen target: a Llama/Qwen-family causal LM run by our own lean forward.

We keep Hugging Face's modules for the weights (and for its `generate()` as the reference), but run
the forward ourselves so that (a) every batch row keeps its own cache length (`KVCache`), (b) the
hidden states of the drafter's context layers come out of the same pass, and (c) single-token decode
pays as little Python overhead as possible: q/k/v and gate/up projections are fused into one matmul
each, RoPE tables are precomputed, and no attention-mask machinery runs when none is needed. On CPU
in float32 `pack_linears()` (done by `load_target`) pre-packs every matrix for oneDNN under the
target's `cpu_kernels`, which makes a verify of 16 tokens cost little more than one decode step
(kernels/cpu_linear.py).

Per decoder layer (pre-norm):
    h = x + W_o · Attn(RoPE(norm_q(W_q · n(x))), RoPE(norm_k(W_k · n(x))), W_v · n(x))     n = RMSNorm
    x' = h + W_down · (silu(W_gate · n(h)) ⊙ W_up · n(h))
norm_q / norm_k are Qwen3's per-head RMSNorms (identity for Llama).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from drelay_model.attention import attend, attention_path, compute_dtype, prepare_mask
from drelay_model.kernels import cpu_linear
from drelay_model.kv_cache import KVCache

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass(frozen=True)
class TargetOutput:
    """One target forward.

    logits    [B, T, V] float32 (only the positions asked for when `logits_at` is given: [B, T', V])
    features  [B, T, len(feature_layers) * D] or None: the drafter's context features, i.e. the
              concatenated outputs of the chosen decoder layers at every new position.
    """

    logits: torch.Tensor
    features: torch.Tensor | None


class _FusedLayer(nn.Module):
    """Fused, frozen weights of one decoder layer.

    The concatenated q/k/v and gate/up matrices are non-persistent buffers (so `.to()` moves and casts
    them with the model); the other weights are read through the Hugging Face layer they belong to.
        qkv      [(n_q + 2 n_kv) * hd, D]      qkv_bias [(n_q + 2 n_kv) * hd] or None
        gate_up  [2 * I, D]
    """

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        biases = [p.bias for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
        qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach()
        self.register_buffer("qkv", qkv, persistent=False)
        self.register_buffer("qkv_bias", torch.cat(biases).detach() if biases[0] is not None else None, persistent=False)
        self.register_buffer("gate_up", torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach(), persistent=False)
        self._src = (layer,)  # a tuple, not a submodule: the HF layer is already registered under `hf`
        self.packed: dict[str, torch.Tensor] = {}  # name → oneDNN-packed copy (TargetModel.pack_linears)

    def __getstate__(self):
        """Copies and pickles leave the packed (opaque, storage-less) tensors behind."""
        return {**super().__getstate__(), "packed": {}}

    @property
    def in_norm(self) -> torch.Tensor:
        return self._src[0].input_layernorm.weight

    @property
    def post_norm(self) -> torch.Tensor:
        return self._src[0].post_attention_layernorm.weight

    @property
    def q_norm(self) -> torch.Tensor | None:
        norm = getattr(self._src[0].self_attn, "q_norm", None)
        return norm.weight if norm is not None else None

    @property
    def k_norm(self) -> torch.Tensor | None:
        norm = getattr(self._src[0].self_attn, "k_norm", None)
        return norm.weight if norm is not None else None

    @property
    def o(self) -> torch.Tensor:
        return self._src[0].self_attn.o_proj.weight

    @property
    def down(self) -> torch.Tensor:
        return self._src[0].mlp.down_proj.weight


class TargetModel(nn.Module):
    """Frozen target LM with per-row KV caching and context-feature extraction.

    cpu_kernels: the CPU kernel settings this target packs with (`pack_linears`) and that a drafter
    bound to it takes unless given its own (default: `CpuKernels.from_env()`).
    """

    def __init__(
        self, hf_model: nn.Module, *, name: str, tokenizer=None, cpu_kernels: cpu_linear.CpuKernels | None = None
    ) -> None:
        super().__init__()
        self.cpu_kernels = cpu_kernels if cpu_kernels is not None else cpu_linear.CpuKernels.from_env()
        cfg = hf_model.config
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            from drelay_model.errors import DRelayError

            raise DRelayError(
                f"target '{name}': model_type '{cfg.model_type}' is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        hf_model.eval().requires_grad_(False)
        self.hf = hf_model
        self.name = name
        self.tokenizer = tokenizer
        self.config = cfg
        self.hidden_size: int = cfg.hidden_size
        self.vocab_size: int = cfg.vocab_size
        self.num_layers: int = cfg.num_hidden_layers
        self.n_heads: int = cfg.num_attention_heads
        self.n_kv_heads: int = cfg.num_key_value_heads
        self.head_dim: int = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps: float = cfg.rms_norm_eps
        self.max_positions: int = cfg.max_position_embeddings
        self.eos_token_ids: tuple[int, ...] = _eos_ids(hf_model)
        self._layers = nn.ModuleList(_FusedLayer(layer) for layer in hf_model.model.layers)
        cos, sin = _rope_tables(hf_model, self.max_positions)  # [P, hd] each
        self.register_buffer("_rope_cos", cos, persistent=False)
        self.register_buffer("_rope_sin", sin, persistent=False)

    def _apply(self, fn, recurse: bool = True):
        """`.to()` / `.cuda()` / `.half()`: move everything, then re-derive the RoPE tables from the
        moved rotary module (as HF does per forward), so a dtype round trip never keeps rounded tables."""
        super()._apply(fn, recurse)
        cos, sin = _rope_tables(self.hf, self.max_positions)
        self._rope_cos, self._rope_sin = cos, sin  # replaces the registered buffers
        self.unpack_linears()  # packed copies belong to the old device/dtype
        return self

    # ---- CPU: pre-packed linears ---------------------------------------------------------------
    def pack_linears(self) -> bool:
        """Pre-pack every matrix for oneDNN under `cpu_kernels` (float32 on CPU only; see
        kernels/cpu_linear.py). Costs one more copy of the weights in memory; returns whether
        anything was packed."""
        head = cpu_linear.pack(self.lm_head_weight, self.cpu_kernels)
        if head is None:
            return False
        self._head_packed = head
        for w in self._layers:
            w.packed = {name: cpu_linear.pack(getattr(w, name), self.cpu_kernels) for name in ("qkv", "o", "gate_up", "down")}
        return True

    def __getstate__(self):
        return {**super().__getstate__(), "_head_packed": None}

    def unpack_linears(self) -> None:
        self._head_packed = None
        for w in getattr(self, "_layers", ()):
            w.packed = {}

    @property
    def packed(self) -> bool:
        return getattr(self, "_head_packed", None) is not None

    # ---- frozen pieces the drafter shares ------------------------------------------------------
    @property
    def embed_weight(self) -> torch.Tensor:
        """[V, D] frozen token embedding."""
        return self.hf.model.embed_tokens.weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[V, D] frozen vocabulary readout (tied to the embedding for SmolLM2)."""
        return self.hf.lm_head.weight

    @property
    def final_norm_weight(self) -> torch.Tensor:
        return self.hf.model.norm.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_weight.device

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """[B, T] int64 → [B, T, D]."""
        return F.embedding(ids, self.embed_weight)

    def new_cache(self, batch_size: int, capacity: int) -> KVCache:
        return KVCache(
            n_layers=self.num_layers,
            batch_size=batch_size,
            n_kv_heads=self.n_kv_heads,
            head_dim=self.head_dim,
            capacity=min(capacity, self.max_positions),
            dtype=self.dtype,
            device=self.embed_weight.device,
        )

    # ---- the forward ---------------------------------------------------------------------------
    # no_grad rather than inference_mode: the features feed drafter training, and inference
    # tensors cannot be saved for backward.
    @torch.no_grad()
    def forward(
        self,
        ids: torch.Tensor,
        cache: KVCache,
        *,
        feature_layers: tuple[int, ...] = (),
        logits_at: torch.Tensor | None = None,
    ) -> TargetOutput:
        """Run `T` new tokens per row through the target, appending them to `cache`.

        Args:
            ids             [B, T] int64, the tokens at cache positions lengths[b] .. lengths[b]+T-1.
            cache           per-row KV cache; every new token is committed (crop afterwards to reject).
            feature_layers  decoder layers whose outputs form the drafter's context features.
            logits_at       optional [B, T'] int64 indices into the T new positions: only those
                            positions go through the final norm and LM head (prefill needs one).
        Returns:
            TargetOutput with logits [B, T or T', V] float32 and features [B, T, L*D] or None.
        """
        B, T = ids.shape
        positions, mask = cache.begin(T)  # [B, T], [B, 1, T, kv] | None
        cos = self._rope_cos[positions][:, None]  # [B, 1, T, hd]
        sin = self._rope_sin[positions][:, None]
        x = self.embed(ids)  # [B, T, D]
        path = attention_path(x.device)  # one fused attention kernel per device (drelay_model/attention.py)
        mask = prepare_mask(mask, path, compute_dtype(x))
        feats = []
        for i, layer in enumerate(self._layers):
            x = self._layer_forward(layer, i, x, cache, cos, sin, mask, path)
            if i in feature_layers:
                feats.append(x)
        cache.end()
        features = None
        if feature_layers:
            features = torch.cat([feats[sorted(feature_layers).index(l)] for l in feature_layers], dim=-1)
        if logits_at is not None:
            x = torch.gather(x, 1, logits_at[:, :, None].expand(-1, -1, x.shape[-1]))
        x = F.rms_norm(x, (x.shape[-1],), self.final_norm_weight, self.eps)
        logits = cpu_linear.linear(x, self.lm_head_weight, None, getattr(self, "_head_packed", None)).float()
        return TargetOutput(logits=logits, features=features)

    def _layer_forward(self, w: _FusedLayer, i: int, x, cache: KVCache, cos, sin, mask, path: str) -> torch.Tensor:
        B, T, D = x.shape
        hd, nq, nkv = self.head_dim, self.n_heads, self.n_kv_heads
        h = F.rms_norm(x, (D,), w.in_norm, self.eps)
        lin = cpu_linear.linear
        qkv = lin(h, w.qkv, w.qkv_bias, w.packed.get("qkv")).view(B, T, nq + 2 * nkv, hd)
        q, k, v = qkv.split((nq, nkv, nkv), dim=2)  # [B, T, n, hd]
        if w.q_norm is not None:
            q = F.rms_norm(q, (hd,), w.q_norm.to(q.dtype), self.eps)  # bf16 autocast: keep the fused kernel
            k = F.rms_norm(k, (hd,), w.k_norm.to(k.dtype), self.eps)
        q = _apply_rope(q.transpose(1, 2), cos, sin)  # [B, nq, T, hd]
        k = _apply_rope(k.transpose(1, 2), cos, sin)  # [B, nkv, T, hd]
        k_all, v_all = cache.append(i, k, v.transpose(1, 2))  # [B, nkv, kv, hd]
        attn = attend(q, k_all, v_all, mask, path)  # [B, nq, T, hd]
        x = x + lin(attn.transpose(1, 2).reshape(B, T, nq * hd), w.o, None, w.packed.get("o"))
        h = F.rms_norm(x, (D,), w.post_norm, self.eps)
        gate, up = lin(h, w.gate_up, None, w.packed.get("gate_up")).chunk(2, dim=-1)
        return x + lin(F.silu(gate) * up, w.down, None, w.packed.get("down"))


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, n, T, hd]; cos/sin [B, 1, T, hd] → x·cos + rotate_half(x)·sin (HF's half-split RoPE)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _rope_tables(hf_model: nn.Module, n_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [n_positions, hd] from the model's own rotary module (so every RoPE variant matches)."""
    rotary = hf_model.model.rotary_emb
    probe = hf_model.model.embed_tokens.weight[:1]
    pos = torch.arange(n_positions, device=probe.device)[None]
    with torch.no_grad():
        cos, sin = rotary(probe, pos)
    return cos[0].contiguous(), sin[0].contiguous()


def _eos_ids(hf_model: nn.Module) -> tuple[int, ...]:
    eos = getattr(hf_model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = hf_model.config.eos_token_id
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
