"""One training step of the drafter, alone or jointly with a trainable selector (DRelay §5, Eq. 4).

    L_t = Σ_{b,i} m_{b,i} [ w_slot(i) · (−log q_{b,i}(y_{b,i})) + α_t w_{b,i} ℓ^sel_{b,i} ] / Σ_{b,i} m_{b,i}

b runs over anchor blocks (B sequences × M anchors, flattened), i over the H slots. The selector sees
the block's pool (top-K of the drafter's softmax), the block's hidden states, the last N verified
target features before the anchor, and a prefix memory of the target-greedy labels under a strict
j < i mask; teacher tokens never enter Global Read. Gradients of the selector term flow into the
backbone through the slot states and pool log-probabilities (joint training).

`DraftTrainModule` holds drafter + selector so that one DDP wrapper syncs both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from drelay_model.training import losses
from drelay_model.drafter.model import BlockDrafter, DraftBlock
from drelay_model.selectors.base import SelectorLossKnobs, SelectorTrainInputs
from drelay_model.selectors.drelay.objective import decision_metrics, decision_outcomes  # re-exported
from drelay_model.training.anchors import eligible_anchors, make_blocks, sample_uniform_anchors, scout_anchors
from drelay_model.training.schedules import slot_weights


class DraftTrainModule(nn.Module):
    """Drafter (+ optional trainable selector) as one module: what DDP wraps."""

    def __init__(self, drafter: BlockDrafter, selector: nn.Module | None = None) -> None:
        super().__init__()
        self.drafter = drafter
        self.selector = selector

    def forward(self, anchor_ids, anchor_pos, features, sel_inputs: SelectorTrainInputs | None = None):
        """anchors [B, M]; features [B, N, F] → (logits [B, M, H, V], block DraftBlock over B·M, sel).

        `sel` is the selector's own `SelectorTrainLoss` on the drafted blocks (given `sel_inputs`:
        labels, valid mask, history, knobs; the block and anchors are filled in here), or None.
        """
        d = self.drafter
        hidden = d(anchor_ids, anchor_pos, features)[:, :, 1:]  # [B, M, H, D]
        B, M, H, D = hidden.shape
        logits = d.logits(hidden)  # [B, M, H, V]
        block = d.pool(hidden.reshape(B * M, H, D))  # cand_logq keeps its gradient
        sel = None
        if self.selector is not None and sel_inputs is not None:
            sel = self.selector.training_loss(sel_inputs.with_block(block, anchor_ids.reshape(-1)))
        return logits, block, sel


@dataclass(frozen=True)
class StepConfig:
    """Per-step knobs; schedules (native fraction, α, β) are evaluated by the caller."""

    anchors_per_seq: int
    native_fraction: float
    slot_decay: float | None = 7.0
    alpha: float = 1.0  # selector coefficient α_t
    progress: float = 1.0  # training progress ∈ [0, 1] (selectors whose loss mixes terms on a schedule)
    beta: float = 1.0  # credit blend β_t (0 = uniform weights)
    credit_floor: float = 0.1
    credit_cap: float = 4.0
    switches: losses.LossSwitches = losses.LossSwitches()


@dataclass
class StepOutput:
    loss: torch.Tensor
    metrics: dict[str, float]


def history_windows(features: torch.Tensor, anchors: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n verified features before each anchor, right-aligned (as the engine's VerifiedHistory).

    features [B, N, F], anchors [B, M] → (windows [B·M, n, F], mask [B·M, n] bool).
    """
    B, N, F = features.shape
    pos = anchors[:, :, None] - n + torch.arange(n, device=anchors.device)  # [B, M, n]
    mask = pos >= 0
    win = torch.gather(features[:, None].expand(B, anchors.shape[1], N, F), 2, pos.clamp(min=0)[..., None].expand(-1, -1, -1, F))
    win = win * mask[..., None]
    return win.reshape(-1, n, F), mask.reshape(-1, n)


def training_step(
    model: nn.Module,
    core: DraftTrainModule,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    features: torch.Tensor,
    cfg: StepConfig,
    generator: torch.Generator,
    *,
    label_ids: torch.Tensor | None = None,
) -> StepOutput:
    """Anchors (uniform + scout) → blocks → Eq. 4. `model` may be the DDP wrapper of `core`.

    input_ids, loss_mask [B, N]; features [B, N, F]; label_ids [B, N] (default input_ids: the
    response is the target's own greedy output).
    """
    labels_src = input_ids if label_ids is None else label_ids
    B, N = input_ids.shape
    drafter, selector = core.drafter, core.selector
    H = drafter.config.num_slots
    n_native = int(round(cfg.anchors_per_seq * cfg.native_fraction))
    anchors, ok = sample_uniform_anchors(eligible_anchors(loss_mask), cfg.anchors_per_seq - n_native, generator)
    if n_native:
        with torch.no_grad():
            ctx = drafter.context_kv(features, torch.arange(N)[None].expand(B, N))
        nat, nat_ok = scout_anchors(drafter, ctx, input_ids, labels_src, loss_mask, n_native, generator)
        anchors, ok = torch.cat([anchors, nat], 1), torch.cat([ok, nat_ok], 1)
    blocks = make_blocks(labels_src, loss_mask, anchors, ok, H)
    labels, valid = blocks.labels.reshape(-1, H), blocks.valid.reshape(-1, H)  # [B·M, H]
    sel_inputs = None
    if selector is not None:
        history = hmask = None
        if selector.capabilities.history_len:
            history, hmask = history_windows(features, anchors, selector.capabilities.history_len)
        knobs = SelectorLossKnobs(
            beta=cfg.beta, credit_floor=cfg.credit_floor, credit_cap=cfg.credit_cap, credit=cfg.switches.credit, progress=cfg.progress
        )
        sel_inputs = SelectorTrainInputs(labels=labels, valid=valid, history=history, history_mask=hmask, knobs=knobs)
    logits, block, sel_out = model(torch.gather(input_ids, 1, anchors), anchors, features, sel_inputs)
    support = losses.support_ce(logits.flatten(0, 1), labels, valid, draft_to_target=drafter.draft_to_target)
    w_slot = slot_weights(H, cfg.slot_decay).to(support.nll.dtype)
    support = losses.SupportLoss(nll=support.nll * w_slot, counted=support.counted, out_of_vocab=support.out_of_vocab)
    metrics = _support_metrics(drafter, logits, blocks, support)
    if sel_out is None:
        denom = valid.sum().clamp(min=1)
        loss = support.nll.sum() / denom if cfg.switches.support else logits.sum() * 0.0
        metrics["loss/support"] = float(support.nll.detach().sum() / denom)
        return StepOutput(loss=loss, metrics=metrics)
    # Eq. 4: L_t = [Σ m·(−log q(y)) + α_t Σ m w ℓ_sel] / Σ m, the selector's term from its own loss.
    denom = valid.float().sum().clamp(min=1.0)
    zero = denom.new_zeros(())
    sup = (support.nll * support.counted).sum() / denom if cfg.switches.support else zero
    slt = cfg.alpha * sel_out.weighted_sum / denom if cfg.switches.selector else zero
    loss = sup + slt
    coverage = ((block.cand_ids == labels[..., None]).any(-1) & valid).float().sum() / denom
    metrics.update({
        "loss/support": sup.item(), "loss/selector": slt.item(), "loss/total": loss.item(),
        "pool/coverage": coverage.item(), "selector/alpha": cfg.alpha, "selector/credit_beta": cfg.beta,
        **sel_out.metrics,
    })
    return StepOutput(loss=loss, metrics=metrics)


def _support_metrics(drafter, logits, blocks, support) -> dict[str, float]:
    with torch.no_grad():
        top1 = (drafter.to_target_ids(logits.argmax(-1)) == blocks.labels) & blocks.valid
        first = blocks.valid[:, :, 0].sum().clamp(min=1)
        return {
            "acc/slot1": float(top1[:, :, 0].sum() / first),
            "valid_tokens": float(blocks.valid.sum()),
            "anchors": float(blocks.valid[:, :, 0].sum()),
            "draft_vocab/out_of_vocab": float(support.out_of_vocab),
        }


def unwrap(module: nn.Module) -> nn.Module:
    """The module inside a DDP/FSDP wrapper (or the module itself)."""
    return getattr(module, "module", module)


__all__ = ["DraftBlock", "DraftTrainModule", "StepConfig", "StepOutput", "decision_metrics", "decision_outcomes", "history_windows", "training_step", "unwrap"]
