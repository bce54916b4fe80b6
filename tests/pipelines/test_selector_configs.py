"""Training configs accept every trainable selector of the registry by name; a frozen backbone trains
only the selector; `selector.fresh` ignores a selector stored in the init checkpoint."""

from __future__ import annotations

import pytest
import torch

from drelay_model.drafter import BlockDrafter, DrafterConfig, save_drafter
from drelay_model.errors import DRelayError
from drelay_model.selectors import default_registry, trainable_selectors
from drelay_model.target import tiny_target
from pipelines.train.config import load_config
from pipelines.train.model_io import build_module


@pytest.mark.parametrize("name", trainable_selectors())
def test_every_trainable_selector_is_a_valid_selector_name(name):
    assert load_config(None, [f"selector.name={name}"]).selector.name == name


def test_untrainable_or_unknown_selector_names_are_one_line_errors():
    for bad in ("ar", "magic"):
        with pytest.raises(
            DRelayError, match=rf"selector.name: .*'{bad}' is not a trainable selector \(choose from: native, drelay"
        ):
            load_config(None, [f"selector.name={bad}"])


def test_freeze_needs_a_checkpoint_and_a_selector():
    with pytest.raises(DRelayError, match="drafter.freeze needs drafter.init_checkpoint"):
        load_config(None, ["drafter.freeze=true", "selector.name=dcoco"])
    with pytest.raises(DRelayError, match="drafter.freeze needs"):
        load_config(None, ["drafter.freeze=true", "drafter.init_checkpoint=x", "selector.name=native"])


def test_grow_layers_deepens_the_init_checkpoint(tmp_path):
    """`drafter.grow_layers` needs a checkpoint to deepen (and a drafter that trains); the built
    module has the checkpoint's layers plus the grown ones."""
    with pytest.raises(DRelayError, match="drafter.grow_layers deepens a trained drafter"):
        load_config(None, ["drafter.grow_layers=1"])
    with pytest.raises(DRelayError, match="drafter.grow_layers"):
        load_config(None, ["drafter.grow_layers=-1", "drafter.init_checkpoint=x"])
    target = tiny_target("tiny-llama")
    save_drafter(BlockDrafter(DrafterConfig.for_target(target, num_layers=1), target), tmp_path / "ck")
    base = [f"drafter.init_checkpoint={tmp_path / 'ck'}", "target.spec=tiny-llama"]
    module = build_module(load_config(None, [*base, "drafter.grow_layers=2"]), target, [])
    assert module.drafter.config.num_layers == len(module.drafter.layers) == 3


def test_frozen_backbone_trains_only_a_fresh_selector(tmp_path):
    target = tiny_target("tiny-llama")
    torch.manual_seed(0)
    drafter = BlockDrafter(DrafterConfig.for_target(target, num_layers=1), target)
    trained = default_registry().create("drelay", drafter=drafter, config={"d_sel": 32, "read_dim": 32, "compact_dim": 16})
    for p in trained.residual_heads():
        torch.nn.init.normal_(p)
    extra = {f"selector.{k}": v for k, v in trained.state_dict().items()}
    save_drafter(
        drafter, tmp_path / "ck", extra_tensors=extra, meta={"selector": {"name": "drelay", "config": trained.config.to_dict()}}
    )
    base = [f"drafter.init_checkpoint={tmp_path / 'ck'}", "drafter.freeze=true", "target.spec=tiny-llama"]
    for name in trainable_selectors():
        module = build_module(load_config(None, [*base, f"selector.name={name}", "selector.fresh=true"]), target, [])
        assert not any(p.requires_grad for p in module.drafter.parameters())
        assert all(p.requires_grad for p in module.selector.parameters())
        if name == "drelay":  # fresh: the checkpoint's trained residual heads are not loaded
            assert all(torch.count_nonzero(p) == 0 for p in module.selector.residual_heads())
    kept = build_module(load_config(None, [*base, "selector.name=drelay"]), target, [])
    assert all(torch.equal(a, b) for a, b in zip(kept.selector.residual_heads(), trained.residual_heads()))


def test_validation_prompts_are_drawn_across_the_held_out_set():
    """Both stages validate on a seeded draw of the held-out sequences, not on its first (file-order) ones."""
    from pipelines.train.data import TrainSequence
    from pipelines.train.worker import spread

    held_out = [TrainSequence(f"s{i}", (1, 2, 3, i), 3) for i in range(40)]
    first = [s.seq_id for s in spread(held_out, seed=0)[:8]]
    assert first != [s.seq_id for s in held_out[:8]] and len(set(first)) == 8
    assert first == [s.seq_id for s in spread(held_out, seed=0)[:8]]  # seeded: the same draw every time
    assert {s.seq_id for s in spread(held_out, seed=0)} == {s.seq_id for s in held_out}
