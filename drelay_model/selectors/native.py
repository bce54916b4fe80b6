"""`native`: keep candidate 0 at every slot (DFlash's argmax path) — the parity reference.

At T > 0 (`sample`) it draws slot i's token from the drafter's pool at the same temperature,
    q̃_i(k) = softmax_k(log q_ik / T)        (the tempered draft distribution renormalised over the pool)
independently per slot, and reports q̃ so verification can accept with min(1, p/q̃).
"""

from __future__ import annotations

import torch

from drelay_model.drafter.model import DraftBlock
from drelay_model.selectors.base import SelectionContext, Selection, Selector, SelectorCapabilities


class NativeSelector(Selector):
    capabilities = SelectorCapabilities(partial_block=True, samples_path=True, native_path=True)

    def select(self, block: DraftBlock, ctx: SelectionContext) -> Selection:
        B, H, _ = block.cand_ids.shape
        return self.gather(block, torch.zeros(B, H, dtype=torch.long, device=block.cand_ids.device))

    def sample(
        self, block: DraftBlock, ctx: SelectionContext, *, temperature: float | torch.Tensor, generators: list
    ) -> Selection:
        B, H, K = block.cand_ids.shape
        T = temperature if isinstance(temperature, int | float) else temperature.view(B, 1, 1)  # one T, or one per row [B]
        q = torch.softmax(block.cand_logq.float() / T, dim=-1)  # [B, H, K]
        pick = torch.stack([torch.multinomial(q[b], 1, generator=g)[:, 0] for b, g in enumerate(generators)])  # [B, H]
        chosen = self.gather(block, pick)
        return Selection(pool_index=chosen.pool_index, path_ids=chosen.path_ids, length=chosen.length, proposal_q=q)
