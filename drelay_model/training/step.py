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
from drelay_model.selectors.drelay.causal import decide
from drelay_model.training.anchors import PathPolicy, eligible_anchors, make_blocks, sample_uniform_anchors, scout_anchors
from drelay_model.training.schedules import slot_weights


class DraftTrainModule(nn.Module):
    """Drafter (+ optional trainable selector) as one module: what DDP wraps."""

    def __init__(self, drafter: BlockDrafter, selector: nn.Module | None = None) -> None:
        super().__init__()
        self.drafter = drafter
        self.selector = selector

    def forward(self, anchor_ids, anchor_pos, features, prefix_tokens=None, history=None, history_mask=None):
        """anchors [B, M]; features [B, N, F] → (logits [B, M, H, V], block DraftBlock over B·M, out).

        `out` is the selector's SelectorOutput (gate [B·M, H], rank [B·M, H, K]) or None.
        """
        d = self.drafter
        hidden = d(anchor_ids, anchor_pos, features)[:, :, 1:]  # [B, M, H, D]
        B, M, H, D = hidden.shape
        logits = d.logits(hidden)  # [B, M, H, V]
        block = d.pool(hidden.reshape(B * M, H, D))  # cand_logq keeps its gradient
        out = None
        if self.selector is not None:
            out = self.selector.forward_train(
                block, anchor_ids=anchor_ids.reshape(-1), prefix_tokens=prefix_tokens, history=history, history_mask=history_mask
            )
        return logits, block, out


@dataclass(frozen=True)
class StepConfig:
    """Per-step knobs; schedules (native fraction, α, β) are evaluated by the caller."""

    anchors_per_seq: int
    native_fraction: float
    slot_decay: float | None = None  # None: Eq. 4's uniform support term; a float: DFlash's exp(-(i-1)/decay)
    scout_policy: str = "native"  # "native": the scout follows the argmax path; "selector": the selector's
    scout_restart: bool = True  # teacher-forced choices. restart: fresh chains keep m scout anchors per row
    alpha: float = 1.0  # selector coefficient α_t
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
    n_scout = torch.zeros((), device=ok.device)
    if n_native:
        with torch.no_grad():
            ctx = drafter.context_kv(features, torch.arange(N)[None].expand(B, N))
        policy = _selector_policy(selector, features) if cfg.scout_policy == "selector" and selector is not None else None
        nat, nat_ok = scout_anchors(
            drafter, ctx, input_ids, labels_src, loss_mask, n_native, generator, policy=policy, restart=cfg.scout_restart
        )
        anchors, ok = torch.cat([anchors, nat], 1), torch.cat([ok, nat_ok], 1)
        n_scout = nat_ok.sum()
    blocks = make_blocks(labels_src, loss_mask, anchors, ok, H)
    labels, valid = blocks.labels.reshape(-1, H), blocks.valid.reshape(-1, H)  # [B·M, H]
    history = hmask = None
    if selector is not None and selector.capabilities.history_len:
        history, hmask = history_windows(features, anchors, selector.capabilities.history_len)
    logits, block, sel_out = model(torch.gather(input_ids, 1, anchors), anchors, features, labels, history, hmask)
    support = losses.support_ce(logits.flatten(0, 1), labels, valid, draft_to_target=drafter.draft_to_target)
    w_slot = slot_weights(H, cfg.slot_decay).to(support.nll.dtype)
    support = losses.SupportLoss(nll=support.nll * w_slot, counted=support.counted, out_of_vocab=support.out_of_vocab)
    metrics = _support_metrics(drafter, logits, blocks, support)
    metrics["anchors/native_fraction"] = float(n_scout / ok.sum().clamp(min=1))  # realised, vs the schedule
    if sel_out is None:
        denom = valid.sum().clamp(min=1)
        loss = support.nll.sum() / denom if cfg.switches.support else logits.sum() * 0.0
        metrics["loss/support"] = float(support.nll.detach().sum() / denom)
        return StepOutput(loss=loss, metrics=metrics)
    sel = losses.selector_loss(sel_out.gate, sel_out.rank, block.cand_ids, labels, valid)
    joint = losses.joint_loss(
        support, sel, valid, alpha=cfg.alpha, beta=cfg.beta, floor=cfg.credit_floor, cap=cfg.credit_cap, switches=cfg.switches
    )
    metrics.update({
        "loss/support": joint.support.item(), "loss/selector": joint.selector.item(), "loss/total": joint.loss.item(),
        "pool/coverage": joint.coverage.item(), "selector/alpha": cfg.alpha, "selector/credit_beta": cfg.beta,
        **decision_metrics(sel_out.gate, sel_out.rank, block.cand_ids, labels, valid),
    })
    return StepOutput(loss=joint.loss, metrics=metrics)


def _selector_policy(selector: nn.Module, features: torch.Tensor) -> PathPolicy:
    """The scout's path when it follows the selector: Eq. 2's decisions under the teacher prefix.

    Up to the first slot whose choice differs from the teacher token, the teacher prefix is exactly
    the prefix incremental selection writes, so the accepted count A equals what decoding accepts.
    """
    n = selector.capabilities.history_len

    def choose(block: DraftBlock, anchor_ids: torch.Tensor, anchor_pos: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        history = hmask = None
        if n:
            history, hmask = history_windows(features, anchor_pos[:, None], n)
        out = selector.forward_train(block, anchor_ids=anchor_ids, prefix_tokens=labels, history=history, history_mask=hmask)
        pick = decide(out.gate.float(), out.rank.float())  # [B, H] pool index
        return block.cand_ids.gather(-1, pick[..., None])[..., 0]

    return choose


@torch.no_grad()
def decision_outcomes(gate, rank, cand_ids, labels, valid) -> dict[str, torch.Tensor]:
    """Teacher-forced decisions by Eq. 2's rule, as bool masks [R, H] over the valid slots —
    gate [R, H], rank [R, H, K], cand_ids [R, H, K], labels/valid [R, H]:
      valid    the slot is supervised
      native   pool index 0 (the native argmax) is the label
      chosen   the selector's choice is the label
      repairs  the rule picks k > 0
      fixed / broke / swapped  repairs that turn a wrong native token right / a right one wrong /
               one wrong token into another
    """
    pick = decide(gate.float(), rank.float())  # [R, H]
    chosen = cand_ids.gather(-1, pick[..., None])[..., 0]
    native_ok, chosen_ok, repair = (cand_ids[..., 0] == labels) & valid, (chosen == labels) & valid, (pick > 0) & valid
    return {
        "valid": valid, "native": native_ok, "chosen": chosen_ok, "repairs": repair,
        "fixed": repair & chosen_ok & ~native_ok, "broke": repair & native_ok & ~chosen_ok,
        "swapped": repair & ~native_ok & ~chosen_ok,
    }  # fmt: skip


def decision_metrics(gate, rank, cand_ids, labels, valid) -> dict[str, float]:
    """Is the selector better than the native argmax yet? `decision_outcomes` as shares of the valid
    slots: selector/acc (chosen), selector/native_acc, selector/repair_rate, selector/fixed, selector/broke."""
    out = decision_outcomes(gate, rank, cand_ids, labels, valid)
    n = valid.sum().clamp(min=1)
    names = {"chosen": "acc", "native": "native_acc", "repairs": "repair_rate", "fixed": "fixed", "broke": "broke"}
    return {f"selector/{name}": float(out[key].sum() / n) for key, name in names.items()}


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
