"""The cost cache's key: what the round costs depend on (architectures, dtype, machine), never where a
checkpoint lies, so copies of one checkpoint share a surface and another drafter size gets its own."""

from __future__ import annotations

import shutil

import pytest

from drelay_model.decoding.cost_policy import costs_path
from drelay_model.decoding.cost_policy.cache import cost_key
from drelay_model.drafter import BlockDrafter, DrafterConfig
from drelay_model.drafter.checkpoint import load_drafter, save_drafter
from drelay_model.selectors import default_registry
from drelay_model.target import tiny_target

SELECTOR = "dcoco"  # trainable: its weights ride in the checkpoint


@pytest.fixture(scope="module")
def target():
    return tiny_target("tiny-llama")


def _checkpoint(target, path, **overrides):
    drafter = BlockDrafter(DrafterConfig.for_target(target, num_layers=1, **overrides), target)
    selector = default_registry().create(SELECTOR, drafter=drafter)
    tensors = {f"selector.{k}": v for k, v in selector.state_dict().items()}
    return save_drafter(drafter, path, extra_tensors=tensors, meta={"selector": {"name": SELECTOR, "config": None}})


def _load(target, path):
    drafter, tensors, meta = load_drafter(path, target)
    selector = default_registry().from_checkpoint(SELECTOR, drafter=drafter, tensors=tensors, meta=meta)
    return drafter, selector


def test_two_copies_of_one_checkpoint_share_a_key(target, tmp_path):
    first = _checkpoint(target, tmp_path / "checkout-a" / "drafter")
    second = tmp_path / "elsewhere" / "copy"
    shutil.copytree(first, second)
    a, b = _load(target, first), _load(target, second)
    assert cost_key(target, *a, method=SELECTOR) == cost_key(target, *b, method=SELECTOR)
    path = costs_path(target, *a, method=SELECTOR)
    assert path == costs_path(target, *b, method=SELECTOR)
    assert "checkout-a" not in path.name and str(tmp_path) not in path.name


def test_another_drafter_size_selector_or_method_gets_another_key(target, tmp_path):
    base = _load(target, _checkpoint(target, tmp_path / "base"))
    wider = _load(target, _checkpoint(target, tmp_path / "wider", intermediate_size=3 * target.hidden_size))
    deeper = BlockDrafter(DrafterConfig.for_target(target, num_layers=2), target)
    names = {
        costs_path(target, *base, method=SELECTOR).name,
        costs_path(target, *wider, method=SELECTOR).name,
        costs_path(target, deeper, base[1], method=SELECTOR).name,
        costs_path(target, base[0], None, method="native").name,
    }
    assert len(names) == 4


def test_another_target_architecture_or_dtype_gets_another_key(target):
    drafter = BlockDrafter(DrafterConfig.for_target(target, num_layers=1), target)
    other = tiny_target("tiny-llama", layers=3)
    other_drafter = BlockDrafter(DrafterConfig.for_target(other, num_layers=1), other)
    assert costs_path(target, drafter, None, method="native") != costs_path(other, other_drafter, None, method="native")
    key = cost_key(target, drafter, None, method="native")
    assert key["target"]["dtype"] == "torch.float32" and key["machine"]["threads"] >= 1
