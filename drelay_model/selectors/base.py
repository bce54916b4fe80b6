"""The selector contract: pick one pool entry per slot, producing the path the target verifies."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch
from torch import nn

from drelay_model.drafter.model import DraftBlock


@dataclass(frozen=True)
class SelectorCapabilities:
    """What a selector needs and may do; callers branch on these, never on names.

    trainable         has parameters that training should update (and a checkpoint should hold).
    needs_hidden      reads `DraftBlock.hidden` (slot hidden states), not only the pool.
    history_len       how many of the last strictly verified target features it reads (0: none).
    supports_sampling may be used with T > 0 verification.
    may_shorten       may return a path shorter than H (a per-row `length`).
    partial_block     selects from a block whose pool covers only the first L ≤ H slots (then the
                      drafter evaluates its LM head for those slots only); False: needs all H.
    samples_path      at T > 0 can draw its path from a distribution it reports (`sample`), so
                      verification may use the speculative-sampling rule (verify.accept_sampled).
    native_path       its greedy path is always the drafter's own (pool index 0 at every slot): a
                      cost-aware engine then has no cheaper "keep the native path" round to offer.
    teacher_forced    defines `teacher_forced_path` (the path the training scout follows with
                      `train.scout_policy: selector`; selectors without it are scouted by the argmax).
    """

    trainable: bool = False
    needs_hidden: bool = False
    history_len: int = 0
    supports_sampling: bool = True
    may_shorten: bool = False
    partial_block: bool = False
    samples_path: bool = False
    native_path: bool = False
    teacher_forced: bool = False


@dataclass(frozen=True)
class SelectionContext:
    """What the engine knows beyond the pool when selecting.

    anchor_ids  [B] int64 the anchors of the drafted blocks.
    anchor_pos  [B] int64 their absolute positions (prompt + generated tokens before the anchor).
    row_ids     [B] int64 which request each row is (rows leave the batch as they finish).
    history     [B, N, L*D] the last N verified target features (oldest first), or None when the
                selector asked for none; history_mask [B, N] bool marks real (not padded) entries.
    max_slots   the engine verifies at most this many path tokens this round (cost-aware length), or
                None (up to H). A selector may decide only the first max_slots slots; it then returns
                length ≤ max_slots, and path entries past it are never verified.
    """

    anchor_ids: torch.Tensor
    anchor_pos: torch.Tensor
    row_ids: torch.Tensor
    history: torch.Tensor | None = None
    history_mask: torch.Tensor | None = None
    max_slots: int | None = None

    def __post_init__(self) -> None:
        if self.max_slots is not None and self.max_slots < 1:
            raise ValueError(f"max_slots must be ≥ 1 or None, got {self.max_slots}")


@dataclass(frozen=True)
class Selection:
    """A selector's decision per row.

    pool_index [B, H] int64 index into the pool (0 = native choice)
    path_ids   [B, H] int64 the chosen target tokens
    length     [B] int64 how many path tokens to verify (H unless the selector may shorten)
    proposal_q [B, H, K] the pool probabilities each path token was drawn from (`Selector.sample`),
               or None for a deterministic choice
    """

    pool_index: torch.Tensor
    path_ids: torch.Tensor
    length: torch.Tensor
    proposal_q: torch.Tensor | None = None


@dataclass(frozen=True)
class SelectorLossKnobs:
    """Per-step knobs of a selector's training loss, evaluated by the trainer's schedules.

    beta          credit blend β_t ∈ [0, 1] (0 = uniform weights) for selectors that weight slots by
                  their prefix value (DRelay's Eq. 5); others ignore it, as they do the next three.
    credit_floor  uniform floor f ∈ (0, 1] of the normalised credit weights.
    credit_cap    cap C ≥ 1 on the largest credit weight.
    credit        False = the "Uniform repair weights" ablation.
    progress      training progress ∈ [0, 1] (for selectors whose loss mixes terms on a schedule).
    """

    beta: float = 1.0
    credit_floor: float = 0.1
    credit_cap: float = 4.0
    credit: bool = True
    progress: float = 1.0


@dataclass(frozen=True)
class SelectorTrainInputs:
    """What a trainable selector's loss sees for R = B·M drafted blocks (teacher forcing).

    block         DraftBlock: hidden [R, H, D], cand_ids / cand_logq [R, H, K]; hidden and cand_logq
                  carry the backbone's gradient (joint training). None until the drafter has run.
    anchor_ids    [R] int64 anchors (the verified token before slot 0).
    labels        [R, H] int64 the target's greedy tokens (target vocabulary; any id, in the pool or not).
    valid         [R, H] bool m: supervised positions.
    history       [R, N, F] the last N verified target features before each anchor (right-aligned),
                  or None when the selector reads none; history_mask [R, N] bool marks real entries.
    knobs         SelectorLossKnobs.
    """

    labels: torch.Tensor
    valid: torch.Tensor
    block: DraftBlock | None = None
    anchor_ids: torch.Tensor | None = None
    history: torch.Tensor | None = None
    history_mask: torch.Tensor | None = None
    knobs: SelectorLossKnobs = SelectorLossKnobs()

    def with_block(self, block: DraftBlock, anchor_ids: torch.Tensor) -> "SelectorTrainInputs":
        R, H, _ = block.cand_ids.shape
        assert anchor_ids.shape == (R,) and self.labels.shape == (R, H) == self.valid.shape, "anchors [R], labels/valid [R, H]"
        return replace(self, block=block, anchor_ids=anchor_ids)


@dataclass(frozen=True)
class SelectorTrainLoss:
    """A selector's share of the joint objective (Eq. 4) on one batch of blocks.

    weighted_sum  [] Σ_{b,i} m_{b,i} w_{b,i} ℓ^sel_{b,i}: the selector's per-token loss times its own
                  slot weights, summed; the joint step multiplies by α_t and divides by the common
                  valid-token denominator Σ m (shared with the support CE).
    metrics       float scalars for logging (names under `selector/`).
    """

    weighted_sum: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


class Selector(nn.Module):
    """Base class: subclasses set `capabilities` and implement `select` (and, when trainable,
    `training_loss`)."""

    capabilities: ClassVar[SelectorCapabilities] = SelectorCapabilities()

    @classmethod
    def build(cls, *, drafter=None, config: dict | None = None) -> "Selector":
        """Construct for a drafter (trainable selectors size themselves from it and share its frozen
        embedding). `config` holds selector hyper-parameters, as saved in a checkpoint's meta."""
        if config:
            from drelay_model.errors import DRelayError

            raise DRelayError(f"selector {cls.__name__} takes no config, got keys {sorted(config)}")
        return cls()

    @classmethod
    def saved_config(cls, config: dict | None) -> dict | None:
        """A config as stored in a checkpoint, brought up to date before `build`: a selector whose
        config gained keys fills in what older checkpoints were trained with. Default: unchanged."""
        return config

    def select(self, block: DraftBlock, ctx: SelectionContext) -> Selection:  # pragma: no cover - abstract
        raise NotImplementedError

    def sample(
        self, block: DraftBlock, ctx: SelectionContext, *, temperature: float | torch.Tensor, generators: list
    ) -> Selection:
        """A path drawn at temperature T > 0 (one for the batch, or [B] float32: one per row) with its
        proposal (`capabilities.samples_path`); row b draws only from generators[b]."""
        raise NotImplementedError(f"selector {type(self).__name__} does not sample its path")

    def training_loss(self, inputs: SelectorTrainInputs) -> SelectorTrainLoss:
        """The selector's own loss on teacher-forced blocks (trainable selectors only)."""
        from drelay_model.errors import DRelayError

        raise DRelayError(f"selector {type(self).__name__} is not trainable")

    def teacher_forced_path(self, block: DraftBlock, *, anchor_ids, labels, history=None, history_mask=None) -> torch.Tensor:
        """The path [B, H] (target ids) the selector chooses when the prefix is the teacher tokens
        `labels` [B, H] — what the training scout follows with `train.scout_policy: selector`.
        Before the first slot whose choice differs from the label it equals incremental selection."""
        from drelay_model.errors import DRelayError

        raise DRelayError(f"selector {type(self).__name__} has no teacher-forced path; use train.scout_policy=native")

    @staticmethod
    def gather(block: DraftBlock, pool_index: torch.Tensor, length: torch.Tensor | None = None) -> Selection:
        """Build a Selection from pool indices [B, H] (full length unless given)."""
        B, H, _ = block.cand_ids.shape
        path = torch.gather(block.cand_ids, 2, pool_index[:, :, None])[:, :, 0]  # [B, H]
        if length is None:
            length = torch.full((B,), H, dtype=torch.long, device=path.device)
        return Selection(pool_index=pool_index, path_ids=path, length=length)
