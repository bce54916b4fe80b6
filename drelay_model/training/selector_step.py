"""The selector stage's step: train a selector head alone on blocks a frozen drafter drafted once.

With the drafter frozen, Eq. 4's support term has no trainable parameters and the joint step reduces
to the selector's own term on fixed blocks:

    L_t = α_t · Σ_{b,i} m_{b,i} w_{b,i} ℓ^sel_{b,i} / Σ_{b,i} m_{b,i}

so the blocks (pool, slot hidden states, labels, valid mask, the anchor's verified-history window)
can be read from a cache (`CachedBlocks`) instead of re-running the target and the drafter. The
selector sees exactly what `training_step` would hand it for the same anchors: the same
`SelectorTrainInputs`, filled from stored tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from drelay_model.drafter.model import DraftBlock
from drelay_model.selectors.base import SelectorLossKnobs, SelectorTrainInputs
from drelay_model.training.step import StepConfig, StepOutput


@dataclass(frozen=True)
class CachedBlocks:
    """R drafted blocks (H slots, K candidates, D drafter width) and their sequences' features.

    hidden [R, H, D] bf16; cand_ids [R, H, K] int32; cand_logq [R, H, K] float32; anchor_ids,
    anchor_pos [R] int32; feat_row [R] int64 the anchor's row in `features`; labels [R, H] int32;
    valid [R, H] bool; features [T, F] bf16 (rows of all cached sequences, concatenated) or None
    when no head reads a history window.
    """

    hidden: torch.Tensor
    cand_ids: torch.Tensor
    cand_logq: torch.Tensor
    anchor_ids: torch.Tensor
    anchor_pos: torch.Tensor
    feat_row: torch.Tensor
    labels: torch.Tensor
    valid: torch.Tensor
    features: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.anchor_ids.shape[0]

    def take(self, idx: torch.Tensor) -> "CachedBlocks":
        """Blocks idx [b] (features shared, not copied)."""
        kw = {f.name: getattr(self, f.name)[idx] for f in fields(self) if f.name != "features"}
        return CachedBlocks(**kw, features=self.features)

    def history(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The n verified features before each anchor, right-aligned, as `step.history_windows`:
        window entry j of block r is feature row feat_row[r] − n + j of its sequence (zeros and
        mask False before the sequence start). → (windows [R, n, F] float32, mask [R, n] bool)."""
        assert self.features is not None, "this cache was loaded without features"
        j = torch.arange(n)
        pos = self.anchor_pos.long()[:, None] - n + j  # [R, n] position in the sequence
        mask = pos >= 0
        rows = torch.where(mask, self.feat_row[:, None] - n + j, 0)
        win = self.features[rows].float() * mask[..., None]  # [R, n, F]
        return win, mask


def selector_inputs(batch: CachedBlocks, selector, cfg: StepConfig, device: torch.device) -> SelectorTrainInputs:
    """`SelectorTrainInputs` of a cached batch on `device` (ids int64, states float32)."""
    block = DraftBlock(
        hidden=batch.hidden.to(device=device, dtype=torch.float32),
        cand_ids=batch.cand_ids.to(device=device, dtype=torch.long),
        cand_logq=batch.cand_logq.to(device=device, dtype=torch.float32),
    )
    history = hmask = None
    n = selector.capabilities.history_len
    if n:
        history, hmask = (t.to(device) for t in batch.history(n))
    knobs = SelectorLossKnobs(beta=cfg.beta, credit_floor=cfg.credit_floor, credit_cap=cfg.credit_cap,
                              credit=cfg.switches.credit, progress=cfg.progress)  # fmt: skip
    inputs = SelectorTrainInputs(
        labels=batch.labels.to(device=device, dtype=torch.long),
        valid=batch.valid.to(device),
        history=history,
        history_mask=hmask,
        knobs=knobs,
    )
    return inputs.with_block(block, batch.anchor_ids.to(device=device, dtype=torch.long))


def selector_step_backward(
    selector, batch: CachedBlocks, cfg: StepConfig, *, autocast_dtype: torch.dtype | None = None
) -> StepOutput:
    """α_t · Σ m·w·ℓ_sel / Σ m on the batch (through `selector.training_loss`), and its backward
    (under autocast only the forward runs in `autocast_dtype`). Several workers average their
    gradients afterwards (the caller). Returns the detached loss and the selector's metrics."""
    device = next(selector.parameters()).device
    inputs = selector_inputs(batch, selector, cfg, device)
    amp = dict(device_type=device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None)
    with torch.autocast(**amp):
        out = selector.training_loss(inputs)
    denom = inputs.valid.sum().clamp(min=1)
    loss = cfg.alpha * out.weighted_sum / denom
    loss.backward()
    covered = (inputs.block.cand_ids == inputs.labels[..., None]).any(-1) & inputs.valid
    metrics = {
        "loss/selector": float(loss.detach()),
        "pool/coverage": float(covered.sum() / denom),
        "acc/slot1": float(((inputs.block.cand_ids[:, 0, 0] == inputs.labels[:, 0]) & inputs.valid[:, 0]).sum()
                           / inputs.valid[:, 0].sum().clamp(min=1)),
        "valid_tokens": float(denom),
        "anchors": float(len(batch)),
        "selector/alpha": cfg.alpha,
        "selector/credit_beta": cfg.beta,
        **out.metrics,
    }  # fmt: skip
    return StepOutput(loss=loss.detach(), metrics=metrics)


def epoch_batches(n: int, size: int, generator: torch.Generator) -> list[torch.Tensor]:
    """A seeded random order of n blocks in batches of `size` (the last partial batch dropped unless
    it is the only one)."""
    order = torch.randperm(n, generator=generator)
    out = [order[i : i + size] for i in range(0, n - size + 1, size)]
    return out or [order]
