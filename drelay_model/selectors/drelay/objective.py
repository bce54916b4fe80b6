"""DRelay's training objective on teacher-forced blocks (§5): Eq. 3 weighted by Eq. 5's prefix credit,
plus decision metrics by Eq. 2's rule. The tensor math lives in `drelay_model.training.losses`.

    ℓ^sel_{b,i}   Eq. 3: BCE(g_i, 0) on KEEP, BCE(g_i, 1) − log r_{i,k_i} on REPAIR, 0 on a pool miss
    w_{b,i}       Eq. 5 credit, normalised per block (floor, cap), blended with uniform weights by β_t
    weighted sum  Σ_{b,i} m_{b,i} w_{b,i} ℓ^sel_{b,i}  (the joint step applies α_t and the denominator)
"""

from __future__ import annotations

import torch

from drelay_model.selectors.base import SelectorTrainInputs, SelectorTrainLoss
from drelay_model.selectors.drelay.causal import decide
from drelay_model.training import losses


def drelay_training_loss(selector, inputs: SelectorTrainInputs) -> SelectorTrainLoss:
    """Eq. 3 × Eq. 5 for a `DRelaySelector`; the prefix memory holds the target's labels (strict j < i)."""
    block, labels, valid, knobs = inputs.block, inputs.labels, inputs.valid, inputs.knobs
    out = selector.forward_train(
        block, anchor_ids=inputs.anchor_ids, prefix_tokens=labels, history=inputs.history, history_mask=inputs.history_mask
    )
    sel = losses.selector_loss(out.gate, out.rank, block.cand_ids, labels, valid)
    weights = losses.repair_weights(
        sel, beta=knobs.beta, floor=knobs.credit_floor, cap=knobs.credit_cap, uniform=not knobs.credit
    )
    weighted_sum = (valid.float() * weights * sel.per_token).sum()
    return SelectorTrainLoss(
        weighted_sum=weighted_sum, metrics=decision_metrics(out.gate, out.rank, block.cand_ids, labels, valid)
    )


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
