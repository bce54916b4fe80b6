"""Run configs: strict keys, ranges, dotted overrides, the shipped experiment files."""

from __future__ import annotations

from pathlib import Path

import pytest

from drelay_model.errors import DRelayError
from pipelines.train.config import Schedule, load_config

EXPERIMENTS = sorted((Path(__file__).resolve().parents[2] / "platform" / "experiments").glob("*/*.yaml"))


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_shipped_configs_validate(path):
    cfg = load_config(path)
    assert cfg.drafter.block_size == 16 and cfg.drafter.top_k == 16


def test_overrides_are_typed_and_nested():
    cfg = load_config(None, ["train.lr=1e-3", "ray.num_workers=2", "drafter.target_layer_ids=[0,1]", "selector.name=drelay"])
    assert cfg.train.lr == 1e-3 and cfg.ray.num_workers == 2 and cfg.train.soft_labels is None
    assert load_config(None, ["train.soft_labels=64"]).train.soft_labels == 64
    assert cfg.drafter.target_layer_ids == (0, 1) and cfg.selector.name == "drelay"


@pytest.mark.parametrize(
    "override, message",
    [
        (["train.colour=1"], "train.colour: Extra inputs are not permitted"),
        (["train.soft_labels=1.5"], "train.soft_labels"),
        (
            [
                "train.stage=selector",
                "drafter.freeze=true",
                "drafter.init_checkpoint=x",
                "selector.name=drelay",
                "train.scout_policy=native",
                "train.soft_labels=8",
            ],
            "train.soft_labels shapes the drafter's support term",
        ),
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


# ---- bounds: every value the code divides by, takes a log of, or uses as a fraction ------------------

BOUNDS = [
    ("train.credit_floor", 0, "greater than 0"),  # the credit normalisation divides by it
    ("train.credit_floor", 1.5, "less than or equal to 1"),
    ("train.credit_cap", 0.5, "greater than or equal to 1"),
    ("train.native_anchor_fraction", {"start": 1.5, "end": 0.5}, "less than or equal to 1"),
    ("train.native_anchor_fraction", {"start": 0.3, "end": -0.1}, "greater than or equal to 0"),
    ("train.credit_blend", {"start": 0.0, "end": 2.0}, "less than or equal to 1"),
    ("train.selector_alpha", {"start": -1.0, "end": 1.0}, "greater than or equal to 0"),
    ("train.selector_alpha", {"start": 0.1, "end": ".inf"}, "finite number"),
    ("train.selector_alpha", {"start": 0.1, "end": 1.0, "ramp_fraction": 0}, "greater than 0"),  # progress / ramp
    ("train.credit_blend", {"start": 0.0, "end": 1.0, "ramp_fraction": 1.5}, "less than or equal to 1"),
    ("train.slot_decay", 0, "greater than 0"),
    ("train.soft_labels", 0, "greater than or equal to 1"),
    ("train.soft_labels", 65, "less than or equal to 64"),  # the top-k the feature forward keeps
    ("train.lr", 0, "greater than 0"),
    ("train.grad_clip", 0, "greater than 0"),
    ("train.max_steps", 0, "greater than or equal to 1"),
    ("train.max_minutes", 0, "greater than 0"),
    ("train.seqs_per_step", 0, "greater than or equal to 1"),
    ("train.anchors_per_seq", 0, "greater than or equal to 1"),
    ("train.checkpoint_every", 0, "greater than or equal to 1"),
    ("train.validate_every", 0, "greater than or equal to 1"),
    ("train.warmup_steps", -1, "greater than or equal to 0"),
    ("data.validation_fraction", 0.5, "less than 0.5"),
    ("data.validation_fraction", -0.1, "greater than or equal to 0"),
    ("ray.num_workers", 0, "greater than or equal to 1"),
    ("selector.name", "magic", "'magic' is not a trainable selector (choose from: native"),
]


@pytest.mark.parametrize("field, value, message", BOUNDS, ids=[f"{f}={v}" for f, v, _ in BOUNDS])
def test_each_bound_exits_2_naming_the_field_and_writes_nothing(tmp_path, capsys, field, value, message):
    import yaml

    from cli import main

    section, key = field.split(".")
    doc = {"output_dir": str(tmp_path / "out"), "ray": {"storage_path": str(tmp_path / "ray")}}
    doc.setdefault(section, {})[key] = value
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump(doc).replace("'.inf'", ".inf"))
    rc = main(["train", "--config", str(config)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"drelay: error: {field}") and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]  # no output, no Ray storage


def test_legacy_selector_name_none_still_loads_as_native():
    with pytest.warns(FutureWarning, match="'none' is deprecated, write 'native'"):
        cfg = load_config(None, ["selector.name=none"])
    assert cfg.selector.name == "native" and not cfg.selector.trains_selector


def test_checkpoint_meta_that_says_none_reads_as_native(tmp_path):
    from drelay_model.drafter import BlockDrafter, DrafterConfig, save_drafter
    from drelay_model.target import tiny_target
    from pipelines.common.methods import trained_selector

    target = tiny_target("tiny-llama")
    drafter = BlockDrafter(DrafterConfig.for_target(target, num_layers=1, top_k=4), target)
    save_drafter(drafter, tmp_path / "ck", meta={"selector": {"name": "none"}})
    assert trained_selector(tmp_path / "ck") == "native"


def test_paper_defaults_and_their_switches():
    """Defaults read the paper (Eq. 4 without a slot decay, α reaching 1 and holding, the scout
    following the selector with restarting chains); the other readings stay selectable."""
    t = load_config(None, []).train
    assert t.slot_decay is None and t.scout_policy == "selector" and t.scout_restart
    assert t.selector_alpha.at(0.3) == pytest.approx(1.0) and t.selector_alpha.at(0.0) == pytest.approx(0.05)
    old = load_config(None, ["train.slot_decay=7.0", "train.scout_policy=native", "train.scout_restart=false"]).train
    assert old.slot_decay == 7.0 and old.scout_policy == "native" and not old.scout_restart
    for bad, field in (("train.slot_decay=0", "train.slot_decay"), ("train.scout_policy=magic", "train.scout_policy")):
        with pytest.raises(DRelayError, match=field):
            load_config(None, [bad])
