"""Run configs: strict keys, ranges, dotted overrides, the shipped experiment files."""

from __future__ import annotations

from pathlib import Path

import pytest

from drelay_model.errors import DRelayError
from pipelines.config import Schedule, load_config

EXPERIMENTS = sorted((Path(__file__).resolve().parents[2] / "platform" / "experiments").glob("*/*.yaml"))


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_shipped_configs_validate(path):
    cfg = load_config(path)
    assert cfg.drafter.block_size == 16 and cfg.drafter.top_k == 16


def test_overrides_are_typed_and_nested():
    cfg = load_config(None, ["train.lr=1e-3", "ray.num_workers=2", "drafter.target_layer_ids=[0,1]", "selector.name=drelay"])
    assert cfg.train.lr == 1e-3 and cfg.ray.num_workers == 2
    assert cfg.drafter.target_layer_ids == (0, 1) and cfg.selector.name == "drelay"


@pytest.mark.parametrize(
    "override, message",
    [
        (["train.colour=1"], "train.colour: Extra inputs are not permitted"),
        (["train.lr=0"], "train.lr: Input should be greater than 0"),
        (["drafter.top_k=0"], "drafter.top_k"),
        (["selector.name=magic"], "selector.name"),
        (["lr"], "bad override 'lr'"),
        (["train.lr=1", "train.lr.x=1"], "'lr' is not a section"),
    ],
)
def test_bad_values_name_the_field(override, message):
    with pytest.raises(DRelayError, match=message):
        load_config(None, override)


def test_bad_files(tmp_path):
    with pytest.raises(DRelayError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed")
    with pytest.raises(DRelayError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- a list")
    with pytest.raises(DRelayError, match="mapping"):
        load_config(bad)


def test_schedule_ramps_then_holds():
    s = Schedule(start=0.3, end=0.5, ramp_fraction=0.5)
    assert s.at(0.0) == pytest.approx(0.3) and s.at(0.25) == pytest.approx(0.4) and s.at(0.9) == pytest.approx(0.5)


def test_paper_defaults_and_their_switches():
    """Defaults read the paper (Eq. 4 without a slot decay, α reaching 1 and holding, the scout's
    chains restarting); today's behaviour stays selectable."""
    t = load_config(None, []).train
    assert t.slot_decay is None and t.scout_policy == "native" and t.scout_restart
    assert t.selector_alpha.at(0.3) == pytest.approx(1.0) and t.selector_alpha.at(0.0) == pytest.approx(0.05)
    old = load_config(None, ["train.slot_decay=7.0", "train.scout_policy=selector", "train.scout_restart=false"]).train
    assert old.slot_decay == 7.0 and old.scout_policy == "selector" and not old.scout_restart
    for bad, field in (("train.slot_decay=0", "train.slot_decay"), ("train.scout_policy=magic", "train.scout_policy")):
        with pytest.raises(DRelayError, match=field):
            load_config(None, [bad])
