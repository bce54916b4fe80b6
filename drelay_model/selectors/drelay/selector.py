"""`drelay`: Global Read once per block, then H causal KEEP/REPAIR decisions (§4, Appendix B).

Inputs per block: the drafter's slot hidden states h [B, H, D], the pool (cand_ids, cand_logq)
[B, H, K], the anchor, and the last N strictly verified target features [B, N, F]. Local features:
    s_i  = LN(W_s h_i) + p_i              slot feature (p_i: learned slot position)
    ê_ik = W_e E(v_ik)                    E: the target's frozen embedding, shared with the drafter as a
                                          non-persistent buffer (never saved, never trained)
Global Read (global_read.py) turns them into z_i, c_ik; the causal selector (causal.py) scores and
decides. Inference (`select`) runs the decisions sequentially, each one writing only the chosen
token into the prefix memory; training (`forward_train`) runs them in parallel with given prefix
tokens (the target's greedy labels) under the same strict j < i visibility.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from drelay_model.kernels.cpu_linear import PackedLinear
from drelay_model.drafter.model import DraftBlock
from drelay_model.errors import DRelayError
from drelay_model.training.losses import log_p_act
from drelay_model.selectors.base import (
    Selection,
    SelectionContext,
    Selector,
    SelectorCapabilities,
    SelectorTrainInputs,
    SelectorTrainLoss,
)
from drelay_model.selectors.drelay.causal import CausalSelector, Evidence, decide
from drelay_model.selectors.drelay.config import DRelayConfig
from drelay_model.selectors.drelay.fast import FastSelect
from drelay_model.selectors.drelay.global_read import GlobalRead
from drelay_model.selectors.drelay.walk import WalkResult, walk, walk_inputs
from drelay_model.selectors.drelay.objective import drelay_training_loss

# Above this many ids, `embed` under autograd projects each distinct id once (a training batch).
_DEDUP_MIN_IDS = 1024


@dataclass(frozen=True)
class SelectorOutput:
    """Gate and rank scores of one block (Eq. 2, Eq. 6).

    gate  [B, H]     float32 gate logit g_i = log Σ_{k>0} q_ik − log q_i0 + Δg_i
    rank  [B, H, K]  float32 rank scores S_ik; r_ik = softmax over k > 0 (column 0 is unused)
    """

    gate: torch.Tensor
    rank: torch.Tensor

    def log_p_act(self) -> torch.Tensor:
        """[B, H, K] log p_act: log σ(−g_i) for k = 0, log σ(g_i) + log r_ik for k > 0."""
        return log_p_act(self.gate, self.rank)

    def decisions(self) -> torch.Tensor:
        """[B, H] int64 pool index chosen by the rule of Eq. 2 at every slot."""
        return decide(self.gate, self.rank)


@dataclass(frozen=True)
class SelectionTrace:
    """`select` together with the scores each sequential decision saw."""

    selection: Selection
    output: SelectorOutput


class DRelaySelector(Selector):
    """Global Read + Causal Selector; see the module docstring."""

    # Class-level for the registry (`trainable`); the instance's history_len follows its config.
    capabilities = SelectorCapabilities(
        trainable=True, needs_hidden=True, history_len=64, supports_sampling=True, partial_block=True, teacher_forced=True
    )

    def __init__(self, config: DRelayConfig, *, embed_weight: torch.Tensor, num_slots: int, top_k: int, feature_dim: int):
        super().__init__()
        if top_k < 2 or num_slots < 1:
            raise DRelayError(
                f"selector 'drelay' needs a pool of at least 2 candidates and 1 slot (got K={top_k}, H={num_slots})"
            )
        d, D = config.d_sel, embed_weight.shape[1]
        self.config = config
        self.num_slots, self.top_k = num_slots, top_k
        self.capabilities = SelectorCapabilities(
            trainable=True,
            needs_hidden=True,
            history_len=config.features_needed,
            supports_sampling=True,
            partial_block=True,
            teacher_forced=True,
        )
        # Frozen, shared with the drafter/target; never saved in a checkpoint.
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.embed_in = PackedLinear(D, d, bias=False)  # W_e
        self.slot_in = PackedLinear(D, d)  # W_s
        self.slot_norm = nn.LayerNorm(d, eps=config.ln_eps)
        self.slot_pos = nn.Parameter(torch.randn(num_slots, d) * 0.02)
        self.global_read = GlobalRead(config, num_slots=num_slots, top_k=top_k) if config.global_read else None
        self.causal = CausalSelector(config, num_slots=num_slots, top_k=top_k, feature_dim=feature_dim)
        self._fast = FastSelect()  # the CPU fast path's caches (not a module: never in the state dict)
        self.fast_path = True  # False: every round runs the reference (a benchmark's "before"); not saved

    @classmethod
    def build(cls, *, drafter=None, config: dict | None = None) -> "DRelaySelector":
        """Size the selector from `drafter` (D, H, K, F) and share its frozen embedding."""
        if drafter is None:
            raise DRelayError("selector 'drelay' needs a drafter to size itself (build(drafter=...))")
        dc = drafter.config
        return cls(
            DRelayConfig.from_dict(config),
            embed_weight=drafter.embed_weight,
            num_slots=dc.num_slots,
            top_k=dc.top_k,
            feature_dim=len(dc.target_layer_ids) * dc.hidden_size,
        )

    @classmethod
    def saved_config(cls, config: dict | None) -> dict:
        """A checkpoint's config with the keys it predates set to what it was trained with."""
        return DRelayConfig.from_saved(config).to_dict()

    def residual_heads(self) -> list[nn.Parameter]:
        """The zero-initialised terminal residual layers (a fresh selector is exactly native)."""
        return self.causal.residual_heads()

    # ---- shared front end ----------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids [...] → projected frozen embeddings ê [..., d].

        Under autograd, with many ids (a training batch: B·H·K pool entries, mostly repeats of a few
        thousand distinct tokens), each distinct id is projected once and the rows gathered back:
        ê = (W_e E[u])[inv] with u, inv = unique(ids). Same values, the projection's forward and
        weight gradient over U ≪ B·H·K rows (the largest matmul of a cached DRelay step otherwise)."""
        if torch.is_grad_enabled() and ids.numel() > _DEDUP_MIN_IDS:
            uniq, inv = torch.unique(ids, return_inverse=True)
            return self.embed_in(F.embedding(uniq, self.embed_weight).to(self.embed_in.weight.dtype))[inv]
        return self.embed_in(F.embedding(ids, self.embed_weight).to(self.embed_in.weight.dtype))

    def evidence(
        self, block: DraftBlock, history: torch.Tensor | None, history_mask: torch.Tensor | None, slots: int | None = None
    ) -> tuple[Evidence, torch.Tensor]:
        """Global Read and every prefix-independent part of the causal selector, once per block.
        `slots` = P < H: Global Read still reads the whole block (it is bidirectional), but the causal
        selector's evidence — per slot, given Global Read's output — is computed for slots 0..P−1 only.

        Returns:
            (Evidence over P slots, cand_emb [B, P, K, d]).
        """
        B, H, K = block.cand_ids.shape
        if K != self.top_k or not 1 <= H <= self.num_slots:
            raise DRelayError(f"drelay selector was built for H={self.num_slots}, K={self.top_k}; got a pool [{B}, {H}, {K}]")
        dtype = self.embed_in.weight.dtype
        s = self.slot_norm(self.slot_in(block.hidden.to(dtype))) + self.slot_pos[:H]  # [B, H, d]
        cand_emb = self.embed(block.cand_ids)  # [B, H, K, d]
        if self.global_read is not None:
            g = self.global_read(s, cand_emb, block.cand_logq)
            z, c = g.z, g.c
        else:  # ablation "No Global Read": local features only
            z, c = s, cand_emb
        if history is not None and history_mask is None:
            history_mask = torch.ones(history.shape[:2], dtype=torch.bool, device=history.device)
        logq = block.cand_logq
        if slots is not None and slots < H:
            s, z, c, cand_emb, logq = s[:, :slots], z[:, :slots], c[:, :slots], cand_emb[:, :slots], logq[:, :slots]
        return self.causal.evidence(s, z, c, cand_emb, logq, history, history_mask), cand_emb

    # ---- training ------------------------------------------------------------------------------
    def forward_train(
        self,
        block: DraftBlock,
        *,
        anchor_ids: torch.Tensor,
        prefix_tokens: torch.Tensor,
        history: torch.Tensor | None = None,
        history_mask: torch.Tensor | None = None,
    ) -> SelectorOutput:
        """Teacher-forced scores, all slots in parallel.

        The prefix memory holds `prefix_tokens` (the target's greedy labels during training; their
        identities are fixed, gradients flow through draft features and memory projections) and
        decision i sees only the anchor and prefix_tokens[:, :i] (strict j < i).

        Args:
            block          DraftBlock with hidden [B, H, D], cand_ids/cand_logq [B, H, K].
            anchor_ids     [B] int64.
            prefix_tokens  [B, H] int64 target-vocabulary ids (any id, in the pool or not).
            history        [B, N, F] last N verified target features (right-aligned), or None.
            history_mask   [B, N] bool, True = a real entry.
        Returns:
            SelectorOutput(gate [B, H], rank [B, H, K]).
        """
        B, H, K = block.cand_ids.shape
        assert anchor_ids.shape == (B,) and prefix_tokens.shape == (B, H), "anchor_ids [B], prefix_tokens [B, H]"
        ev, _ = self.evidence(block, history, history_mask)
        gate, rank = self.causal.teacher_forced(ev, self.embed(anchor_ids), self.embed(prefix_tokens))
        return SelectorOutput(gate=gate, rank=rank)

    def training_loss(self, inputs: SelectorTrainInputs) -> SelectorTrainLoss:
        """Eq. 3 weighted by Eq. 5's prefix credit (see `objective.py`)."""
        return drelay_training_loss(self, inputs)

    @torch.no_grad()
    def teacher_forced_path(self, block: DraftBlock, *, anchor_ids, labels, history=None, history_mask=None) -> torch.Tensor:
        """Eq. 2's decisions with the teacher tokens as prefix → the chosen path [B, H] (target ids)."""
        out = self.forward_train(block, anchor_ids=anchor_ids, prefix_tokens=labels, history=history, history_mask=history_mask)
        pick = decide(out.gate.float(), out.rank.float())  # [B, H] pool index
        return block.cand_ids.gather(-1, pick[..., None])[..., 0]

    def forward(self, block: DraftBlock, **kwargs) -> SelectorOutput:
        """Alias of `forward_train`, so wrappers that call the module (DDP) work."""
        return self.forward_train(block, **kwargs)

    # ---- inference -----------------------------------------------------------------------------
    @torch.inference_mode()
    def select_with_scores(self, block: DraftBlock, ctx: SelectionContext, *, reference: bool = False) -> SelectionTrace:
        """Global Read once, then the H causal decisions (`config.decisions`: the graph-safe walk or
        `CausalSelector.decide_block`, both identical to deciding slot by slot); also returns the
        scores the final decisions saw.

        On CPU with the walk and the torch kernels this runs `FastSelect` (fast.py: the same
        decisions and scores, without recomputing what earlier rounds computed); `reference=True`,
        CUDA, the passes and the Triton kernels run the reference below.

        With `ctx.max_slots` = P < H only the first P decisions are made (decision i depends on
        slots < i alone, so they equal the first P of the full walk); slots P.. keep the native
        candidate with gate −∞ (KEEP) and rank = log q, and the selection's length is P."""
        B, H, K = block.cand_ids.shape
        P = H if ctx.max_slots is None else min(ctx.max_slots, H)  # SelectionContext checks it is ≥ 1
        if not reference and self.uses_fast_path(block):
            if K != self.top_k or not 1 <= H <= self.num_slots:
                raise DRelayError(f"drelay selector was built for H={self.num_slots}, K={self.top_k}; got a pool [{B}, {H}, {K}]")
            res = self._fast.select(self, block, ctx, P)
            pick, gate, rank = res.pool_index, res.gate, res.rank
        else:
            pick, gate, rank = self.reference_decisions(block, ctx, P)
        if P == H:
            return SelectionTrace(selection=self.gather(block, pick), output=SelectorOutput(gate=gate, rank=rank))
        pick = torch.cat([pick, pick.new_zeros(B, H - P)], dim=1)  # [B, H]: native past P
        gate = torch.cat([gate, gate.new_full((B, H - P), float("-inf"))], dim=1)
        rank = torch.cat([rank, block.cand_logq[:, P:].to(rank.dtype)], dim=1)
        length = torch.full((B,), P, dtype=torch.long, device=pick.device)
        return SelectionTrace(selection=self.gather(block, pick, length), output=SelectorOutput(gate=gate, rank=rank))

    def uses_fast_path(self, block: DraftBlock) -> bool:
        """Whether `select` runs `FastSelect` for this block: CPU tensors, the walk with the torch
        kernels, under `torch.inference_mode`, not inside a traced graph, and `fast_path` left on."""
        if torch.compiler.is_compiling():  # first: dynamo cannot trace is_inference_mode_enabled
            return False
        return (
            self.fast_path
            and block.cand_ids.device.type == "cpu"
            and self.config.decisions == "walk"
            and self.config.kernels == "torch"
            and torch.is_inference_mode_enabled()
        )

    def reference_decisions(self, block: DraftBlock, ctx: SelectionContext, P: int) -> tuple[torch.Tensor, ...]:
        """The first P decisions by the reference path → (pick [B, P], gate [B, P], rank [B, P, K])."""
        history = ctx.history if self.config.features_needed else None
        ev, cand_emb = self.evidence(block, history, ctx.history_mask if history is not None else None, slots=P)
        anchor_emb = self.embed(ctx.anchor_ids)
        if self.config.decisions == "walk":
            res = self.walk_decisions(ev, anchor_emb, cand_emb)
            return res.pool_index, res.gate, res.rank
        return self.causal.decide_block(ev, anchor_emb, cand_emb)

    def walk_decisions(self, ev: Evidence, anchor_emb: torch.Tensor, cand_emb: torch.Tensor) -> WalkResult:
        """The graph-safe decision walk (walk.py) on the configured backend (triton is imported
        lazily: it is optional). anchor_emb [B, d]; cand_emb [B, H, K, d]."""
        w = walk_inputs(self.causal, ev, anchor_emb, cand_emb)
        if self.config.kernels == "triton":
            from drelay_model.kernels.walk import walk_triton

            return walk_triton(w)
        return walk(w)

    def select(self, block: DraftBlock, ctx: SelectionContext) -> Selection:
        return self.select_with_scores(block, ctx).selection
