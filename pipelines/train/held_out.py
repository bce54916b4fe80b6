"""Teacher-forced held-out metrics: the drafter's blocks on fixed anchors of the validation
conversations, scored against the target's own tokens (no decoding).

Greedy replay τ (`validate`) is what decoding gets, but it samples only the positions where rounds
start, and one changed round moves every later one: on 32 conversations its 95% interval spans a
few hundredths of τ, more than 45 CPU-minutes of training on this CPU move it. These metrics score
every block at the same fixed anchors each time, so two checkpoints differ only by their weights:

  val/tf_accept    mean over blocks of Σ_i Π_{j≤i} [argmax_j = y_j]: the drafts a greedy round
                   anchored there accepts (1 + this is that round's τ)
  val/tf_acc_slot1 share of blocks whose first draft is the target's token
  val/tf_loss      the support term (Eq. 4: hard labels, uniform slot weights) per valid slot

Anchors: 64 uniform anchors per conversation from a fixed seed (no scout chain, so
the anchors do not depend on the drafter being scored). Features are the target's, computed once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from drelay_model.training.losses import LossSwitches
from drelay_model.training.step import DraftTrainModule, StepConfig, training_step
from pipelines.train.data import collate

SEED = 20_261  # the anchors' draw: the same blocks at every validation of every run
ANCHORS_PER_SEQ = 64  # fixed, whatever the run trains with, so that runs score the same blocks


@dataclass(frozen=True)
class HeldOutBlocks:
    """A fixed teacher-forced batch: ids, response mask [B, N]; features [B, N, F]; its step config."""

    ids: torch.Tensor
    mask: torch.Tensor
    features: torch.Tensor
    step: StepConfig


def held_out_blocks(seqs, features) -> HeldOutBlocks | None:
    """The batch of `seqs` (the validation conversations), with the target's features from
    `features` (the run's `FeatureSource`); None without sequences. Uniform slot weights (Eq. 4),
    whatever the run trains with."""
    if not seqs:
        return None
    ids, mask = collate(seqs)
    step = StepConfig(
        anchors_per_seq=ANCHORS_PER_SEQ,
        native_fraction=0.0,
        slot_decay=None,
        switches=LossSwitches(support=True, selector=False),
    )
    return HeldOutBlocks(ids=ids, mask=mask, features=features(seqs), step=step)


@torch.no_grad()
def teacher_forced_metrics(module, held: HeldOutBlocks, *, rows_per_pass: int = 4) -> dict[str, float]:
    """The module docstring's metrics for the drafter of `module` (its selector is not scored), over
    `rows_per_pass` conversations at a time (a training step's memory), merged exactly: rates over
    blocks weighted by their blocks, the loss by its valid slots."""
    drafter_only = DraftTrainModule(module.drafter, None)
    gen = torch.Generator().manual_seed(SEED)
    blocks = slots = accept = slot1 = loss = 0.0
    for lo in range(0, held.ids.shape[0], rows_per_pass):
        rows = slice(lo, lo + rows_per_pass)
        m = training_step(
            drafter_only, drafter_only, held.ids[rows], held.mask[rows], held.features[rows], held.step, gen
        ).metrics
        blocks, slots = blocks + m["anchors"], slots + m["valid_tokens"]
        accept, slot1 = accept + m["acc/accepted_run"] * m["anchors"], slot1 + m["acc/slot1"] * m["anchors"]
        loss += m["loss/support"] * m["valid_tokens"]
    blocks, slots = max(blocks, 1.0), max(slots, 1.0)
    return {"val/tf_accept": accept / blocks, "val/tf_acc_slot1": slot1 / blocks, "val/tf_loss": loss / slots}
