"""`native`: keep candidate 0 at every slot (DFlash's argmax path) — the parity reference."""

from __future__ import annotations

import torch

from drelay_model.drafter.model import DraftBlock
from drelay_model.selectors.base import SelectionContext, Selection, Selector, SelectorCapabilities


class NativeSelector(Selector):
    capabilities = SelectorCapabilities(partial_block=True)

    def select(self, block: DraftBlock, ctx: SelectionContext) -> Selection:
        B, H, _ = block.cand_ids.shape
        return self.gather(block, torch.zeros(B, H, dtype=torch.long, device=block.cand_ids.device))
