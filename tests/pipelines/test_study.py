"""Study specs: validation, run configs with placeholders, the shipped study, skip-when-finished."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from drelay_model.errors import DRelayError
from cli import main
from pipelines.study.spec import finished, load_study, run_configs

ROOT = Path(__file__).resolve().parents[2]
STUDIES = sorted((ROOT / "platform" / "studies").glob("*.yaml"))


def _repo(tmp_path):
    return lambda p: Path(p) if Path(p).is_absolute() else tmp_path / p


def _write(tmp_path, doc) -> Path:
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _spec(**over):
    doc = {
        "name": "s",
        "stages": [
            {"config": str(ROOT / "platform/experiments/smollm2-135m/train.yaml"), "runs": {"base": ["train.max_steps=10"]}},
            {
                "config": str(ROOT / "platform/experiments/smollm2-135m/train-drelay.yaml"),
                "overrides": ["drafter.init_checkpoint={base}", "train.max_steps=5"],
                "runs": {"native": ["selector.name=native"], "drelay": [], "nogr": ["selector.config.global_read=false"]},
            },
        ],  # fmt: skip
        "compare": {"baseline": "native", "variants": {"pick": "drelay:native"}},
        "ship": "drelay",
    }
    doc.update(over)
    return doc


@pytest.mark.parametrize("path", STUDIES, ids=lambda p: p.name)
def test_shipped_studies_resolve(path):
    spec = load_study(path)
    configs = run_configs(spec, lambda p: ROOT / p)
    last = spec.stages[-1].runs

    # Equal budgets: the runs of the last stage differ only in their own overrides. A time-bound
    # study's budget is its minutes on its clock (runs may trade sequences per step for anchors).
    def budget(t):
        return (t.max_minutes, t.budget_clock) if t.max_minutes else (t.max_steps, t.seqs_per_step)

    budgets = {(budget(configs[r].train), configs[r].drafter.init_checkpoint) for r in last}
    assert len(budgets) == 1


def test_runs_resolve_placeholders_and_names(tmp_path):
    spec = load_study(_write(tmp_path, _spec()))
    configs = run_configs(spec, _repo(tmp_path))
    assert list(configs) == ["base", "native", "drelay", "nogr"]
    assert configs["base"].ray.run_name == "s-base" and configs["base"].selector.name == "native"
    assert configs["drelay"].drafter.init_checkpoint == "outputs/train/s-base/drafter"
    assert configs["nogr"].selector.config["global_read"] is False and configs["drelay"].selector.name == "drelay"
    assert spec.compared() == {"native": "native", "drelay": "drelay", "nogr": "nogr", "pick": "drelay:native"}


def test_finished_reads_the_exported_step(tmp_path):
    configs = run_configs(load_study(_write(tmp_path, _spec())), _repo(tmp_path))
    cfg = configs["base"]
    assert not finished(cfg, _repo(tmp_path))
    doc = tmp_path / "outputs/train/s-base/drafter/drafter_config.json"
    doc.parent.mkdir(parents=True)
    doc.write_text(json.dumps({"meta": {"step": 7}}))
    assert not finished(cfg, _repo(tmp_path))
    doc.write_text(json.dumps({"meta": {"step": 10}}))
    assert finished(cfg, _repo(tmp_path))
    # With a time budget the last checkpoint says so (meta "final"); without one, steps decide.
    budget = cfg.model_copy(update={"train": cfg.train.model_copy(update={"max_minutes": 1.0})})
    doc.write_text(json.dumps({"meta": {"step": 7, "final": True}}))
    assert finished(budget, _repo(tmp_path)) and not finished(cfg, _repo(tmp_path))
    doc.write_text(json.dumps({"meta": {"step": 7, "final": False}}))
    assert not finished(budget, _repo(tmp_path))


@pytest.mark.parametrize(
    "over, message",
    [
        ({"nope": 1}, "nope: Extra inputs are not permitted"),
        ({"name": "bad name"}, "name: String should match pattern"),
        ({"ship": "zzz"}, "ship: 'zzz' is not a run"),
        ({"compare": {"baseline": "zzz"}}, "compare.baseline: 'zzz' is not a compared label"),
        ({"compare": {"variants": {"x": "zzz:native"}}}, "compare: 'zzz' is not a run"),
        ({"compare": {"limit": 0}}, "compare.limit: Input should be greater than or equal to 1"),
        ({"compare": {"checkpoints": {"drelay": "checkpoints/x"}}}, "compare.checkpoints: label 'drelay' is used twice"),
    ],
)
def test_bad_specs_name_the_field(tmp_path, over, message):
    with pytest.raises(DRelayError, match="study spec .*" + message.replace("(", r"\(")):
        load_study(_write(tmp_path, _spec(**over)))


def test_placeholder_must_name_an_earlier_run(tmp_path):
    doc = _spec()
    doc["stages"][0]["overrides"] = ["drafter.init_checkpoint={drelay}"]
    with pytest.raises(DRelayError, match=r"stages.0: '\{drelay\}' does not name a run of an earlier stage"):
        load_study(_write(tmp_path, doc))


def test_bad_run_override_names_the_run(tmp_path):
    doc = _spec()
    doc["stages"][1]["runs"]["drelay"] = ["train.lr=-1"]
    with pytest.raises(DRelayError, match="study run 'drelay': train.lr: Input should be greater than 0"):
        run_configs(load_study(_write(tmp_path, doc)), _repo(tmp_path))


def test_cli_dry_run_and_errors(tmp_path, capsys):
    assert main(["study", "--spec", str(tmp_path / "missing.yaml")]) == 2
    assert "study spec" in capsys.readouterr().err
    path = _write(tmp_path, _spec())
    assert main(["study", "--spec", str(path), "--only", "zzz", "--dry-run"]) == 2
    assert "--only: unknown run label(s) zzz" in capsys.readouterr().err
    assert main(["study", "--spec", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "[study] drelay: run s-drelay, 5 steps, selector drelay — to train" in out


def test_compare_columns_from_checkpoints_outside_the_study(tmp_path, monkeypatch):
    """`compare.checkpoints`: the shipped checkpoint as a column beside the study's runs."""
    from pipelines.study import runner

    spec = load_study(
        _write(tmp_path, _spec(compare={"checkpoints": {"bundled": "checkpoints/smollm2-135m", "picked": "/abs/ck:native"}}))
    )
    jobs = []
    monkeypatch.setattr(runner, "run_compare", jobs.append)
    runner._compare(spec, run_configs(spec, _repo(tmp_path)), progress=False, parent_run_id=None)
    variants = dict(v.split("=", 1) for v in jobs[0].variants)
    assert variants["bundled"].endswith("checkpoints/smollm2-135m") and Path(variants["bundled"]).is_absolute()
    assert variants["picked"] == "/abs/ck:native" and "drelay" in variants
