"""Teacher-forced held-out metrics: the accepted run of a block, fixed anchors (the same blocks every
time), exact merging over passes, and the validation that logs them."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from drelay_model.drafter import BlockDrafter, DrafterConfig
from drelay_model.target import tiny_target
from drelay_model.training.anchors import Blocks
from drelay_model.training.step import DraftTrainModule, _support_metrics
from pipelines.train.data import TrainSequence
from pipelines.train.features import FeatureSource
from pipelines.train.held_out import held_out_blocks, teacher_forced_metrics


def test_the_accepted_run_counts_leading_correct_drafts_of_valid_blocks():
    labels = torch.tensor([[[5, 6, 7, 8], [1, 2, 3, 4], [9, 9, 9, 9]]])  # [B=1, M=3, H=4]
    valid = torch.tensor([[[True] * 4, [True, True, False, False], [False] * 4]])
    top1 = torch.tensor([[[5, 6, 0, 8], [1, 2, 3, 4], [9, 9, 9, 9]]])
    m = _support_metrics(top1, Blocks(anchors=torch.zeros(1, 3, dtype=torch.long), labels=labels, valid=valid),
                         SimpleNamespace(out_of_vocab=0))  # fmt: skip
    # Block 0 accepts 2 (slot 3 wrong), block 1 accepts 2 (its block ends), block 2 is not a block.
    assert m["acc/accepted_run"] == pytest.approx(2.0) and m["acc/slot1"] == pytest.approx(1.0)


@pytest.fixture(scope="module")
def held():
    target = tiny_target("tiny-llama")
    torch.manual_seed(0)
    drafter = BlockDrafter(DrafterConfig.for_target(target, num_layers=1), target)
    rng = random.Random(0)
    seqs = [TrainSequence(f"s{i}", tuple(rng.randrange(target.vocab_size) for _ in range(40 + 7 * i)), 10) for i in range(5)]
    return DraftTrainModule(drafter), held_out_blocks(seqs, FeatureSource(target, drafter.config.target_layer_ids))


def test_metrics_are_the_same_every_time_and_merge_exactly_over_passes(held):
    module, blocks = held
    one = teacher_forced_metrics(module, blocks)
    assert one == teacher_forced_metrics(module, blocks)  # fixed anchors: the same blocks each time
    for rows in (1, 2, 5):
        assert teacher_forced_metrics(module, blocks, rows_per_pass=rows) == pytest.approx(one, rel=1e-5)
    assert 0.0 <= one["val/tf_acc_slot1"] <= one["val/tf_accept"] <= 15.0 and one["val/tf_loss"] > 0
    assert held_out_blocks([], None) is None


def test_the_metrics_move_with_the_drafters_weights(held):
    module, blocks = held
    before = teacher_forced_metrics(module, blocks)
    with torch.no_grad():
        module.drafter.layers[0].down_proj.weight.mul_(3.0)
    try:
        assert teacher_forced_metrics(module, blocks)["val/tf_loss"] != before["val/tf_loss"]
    finally:
        with torch.no_grad():
            module.drafter.layers[0].down_proj.weight.div_(3.0)
