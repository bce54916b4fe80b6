"""train.drafter_lr_scale: a joint run's drafter at lr × scale, its selector at lr; scale 1 keeps one
parameter group (a single-group checkpoint's optimizer state loads); the field is validated."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from pipelines.train.config import TrainSection
from pipelines.train.worker import param_groups


class Joint(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.drafter, self.selector = nn.Linear(3, 3), nn.Linear(3, 2)
        self.drafter.bias.requires_grad_(False)  # frozen parameters join no group


def test_two_groups_with_a_scale_and_one_without():
    m = Joint()
    one = param_groups(m, 1.0)
    assert len(one) == 1 and len(one[0]["params"]) == 3
    two = param_groups(m, 0.25)
    assert [g["lr_scale"] for g in two] == [0.25, 1.0]
    assert two[0]["params"] == [m.drafter.weight] and two[1]["params"] == [m.selector.weight, m.selector.bias]
    opt = torch.optim.AdamW(two, lr=2e-4)
    for g in opt.param_groups:  # what the training loop does each step
        g["lr"] = 2e-4 * g["lr_scale"]
    assert [g["lr"] for g in opt.param_groups] == [5e-5, 2e-4]
    state = torch.optim.AdamW(param_groups(m, 0.25), lr=1.0)
    state.load_state_dict(opt.state_dict())
    assert [g["lr_scale"] for g in state.param_groups] == [0.25, 1.0]


def test_a_drafter_alone_with_a_scale_has_one_group():
    m = Joint()
    m.selector.requires_grad_(False)
    assert [g["lr_scale"] for g in param_groups(m, 0.5)] == [0.5]


@pytest.mark.parametrize("bad", [0.0, -1.0, 1.5, float("nan")])
def test_the_scale_is_validated(bad):
    with pytest.raises(ValidationError, match="drafter_lr_scale"):
        TrainSection(drafter_lr_scale=bad)


def test_the_selector_stage_refuses_a_drafter_rate():
    from drelay_model.errors import DRelayError
    from pipelines.train.config import load_config

    with pytest.raises(DRelayError, match="drafter_lr_scale"):
        load_config("platform/experiments/smollm2-135m/selector-stage.yaml", ["train.drafter_lr_scale=0.5"])
