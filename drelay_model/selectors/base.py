"""The selector contract: pick one pool entry per slot, producing the path the target verifies."""

from __future__ import annotations

from dataclasses import dataclass
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
    """

    trainable: bool = False
    needs_hidden: bool = False
    history_len: int = 0
    supports_sampling: bool = True
    may_shorten: bool = False
    partial_block: bool = False


@dataclass(frozen=True)
class SelectionContext:
    """What the engine knows beyond the pool when selecting.

    anchor_ids  [B] int64 the anchors of the drafted blocks.
    anchor_pos  [B] int64 their absolute positions (prompt + generated tokens before the anchor).
    row_ids     [B] int64 which request each row is (rows leave the batch as they finish).
    history     [B, N, L*D] the last N verified target features (oldest first), or None when the
                selector asked for none; history_mask [B, N] bool marks real (not padded) entries.
    """

    anchor_ids: torch.Tensor
    anchor_pos: torch.Tensor
    row_ids: torch.Tensor
    history: torch.Tensor | None = None
    history_mask: torch.Tensor | None = None


@dataclass(frozen=True)
class Selection:
    """A selector's decision per row.

    pool_index [B, H] int64 index into the pool (0 = native choice)
    path_ids   [B, H] int64 the chosen target tokens
    length     [B] int64 how many path tokens to verify (H unless the selector may shorten)
    """

    pool_index: torch.Tensor
    path_ids: torch.Tensor
    length: torch.Tensor


class Selector(nn.Module):
    """Base class: subclasses set `capabilities` and implement `select`."""

    capabilities: ClassVar[SelectorCapabilities] = SelectorCapabilities()

    @classmethod
    def build(cls, *, drafter=None, config: dict | None = None) -> "Selector":
        """Construct for a drafter (trainable selectors size themselves from it and share its frozen
        embedding). `config` holds selector hyper-parameters, as saved in a checkpoint's meta."""
        if config:
            from drelay_model.errors import DRelayError

            raise DRelayError(f"selector {cls.__name__} takes no config, got keys {sorted(config)}")
        return cls()

    def select(self, block: DraftBlock, ctx: SelectionContext) -> Selection:  # pragma: no cover - abstract
        raise NotImplementedError

    @staticmethod
    def gather(block: DraftBlock, pool_index: torch.Tensor, length: torch.Tensor | None = None) -> Selection:
        """Build a Selection from pool indices [B, H] (full length unless given)."""
        B, H, _ = block.cand_ids.shape
        path = torch.gather(block.cand_ids, 2, pool_index[:, :, None])[:, :, 0]  # [B, H]
        if length is None:
            length = torch.full((B,), H, dtype=torch.long, device=path.device)
        return Selection(pool_index=pool_index, path_ids=path, length=length)
