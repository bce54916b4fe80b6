"""`drelay tune` on a tiny target: real Ray Tune + Ray Train trials, ASHA, MLflow nesting, best config,
and the sweep config's one-line errors (which need no Ray)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from drelay_model.decoding import GenerationConfig, SpeculativeEngine
from drelay_model.errors import DRelayError
from drelay_model.target import tiny_target
from pipelines.cli import main


def tiny_data_file(path: Path) -> Path:
    """Prompt + the tiny target's own greedy continuation, as a tokenized training file."""
    target = tiny_target("tiny-llama")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, target.vocab_size, (8,), generator=g).tolist() for _ in range(48)]
    outs = SpeculativeEngine(target).generate(prompts, GenerationConfig(max_new_tokens=24)).tokens
    path.write_text("".join(json.dumps({"seq_id": f"s{i}", "input_ids": p + o, "response_start": 8}) + "\n" for i, (p, o) in enumerate(zip(prompts, outs))))
    return path


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    return tiny_data_file(tmp_path_factory.mktemp("data") / "tiny.jsonl")


def base_config(data: Path, **over) -> dict:
    doc = {
        "target": {"spec": "tiny-llama"},
        "drafter": {"num_layers": 1, "top_k": 8},
        "data": {"regenerated": str(data), "validation_fraction": 0.1},
        "train": {"max_steps": 12, "checkpoint_every": 6, "validate_every": 3, "seqs_per_step": 4, "anchors_per_seq": 8,
                  "validation_prompts": 3, "warmup_steps": 1, "lr": 3e-3},
        "ray": {"num_workers": 1, "cpus_per_worker": 1, "max_failures": 1},
    }  # fmt: skip
    for dotted, value in over.items():
        section, key = dotted.split(".")
        doc[section][key] = value
    return doc


def write_sweep(tmp_path: Path, data: Path, **over) -> Path:
    spec = {
        "name": "tiny-sweep",
        "base": base_config(data),
        "space": {"train.credit_cap": {"values": [2.0, 4.0, 8.0]}, "train.lr": {"values": [1.0e-2, 1.0e-7]}},
        "search": "grid",
        "scheduler": {"name": "asha", "grace_period": 3, "reduction_factor": 2},
        "num_samples": 1,
        "max_concurrent_trials": 2,
        "output_dir": str(tmp_path / "sweeps"),
    }
    spec.update(over)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


BAD = [
    ({"space": {"train.nope": {"low": 0.1, "high": 0.2}}}, "space: 'train.nope' is not a training-config field"),
    ({"space": {"train.credit_floor": {"low": 0.3, "high": 0.3}}}, "space.train.credit_floor: empty range"),
    ({"space": {"train.credit_floor": {"low": 0.5, "high": 0.2}}}, "space.train.credit_floor: inverted range"),
    ({"space": {"train.credit_floor": {"low": 0.5, "high": 1.5}}}, "space.train.credit_floor: train.credit_floor: Input should be less than or equal to 1"),
    ({"space": {"train.credit_cap": {"values": [0.5, 4.0]}}}, "space.train.credit_cap: train.credit_cap: Input should be greater than or equal to 1"),
    ({"space": {"train.credit_cap": {"values": []}}}, "space.train.credit_cap: values is empty"),
    ({"scheduler": {"name": "hyperband"}}, "scheduler.name: Input should be 'asha' or 'fifo'"),
    ({"search": "bayes"}, "search: Input should be 'random', 'grid' or 'optuna'"),
    ({"space": {"train.lr": {"low": 1e-4, "high": 1e-3}}}, "space.train.lr: grid search needs a list of values"),
    ({"scheduler": {"reduction_factor": 1.0}}, "scheduler.reduction_factor: Input should be greater than 1"),
    ({"typo": 1}, "typo: Extra inputs are not permitted"),
]


@pytest.mark.parametrize("over,message", BAD, ids=[m.split(":")[0] + str(i) for i, (_, m) in enumerate(BAD)])
def test_bad_sweep_is_one_line_and_writes_nothing(tmp_path, tiny_data, capsys, over, message):
    path = write_sweep(tmp_path, tiny_data, **over)
    assert main(["tune", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("drelay: error: ") and message in err and "\n" not in err, err
    assert not (tmp_path / "sweeps").exists()


def test_resume_without_a_sweep_and_rerun_over_results_are_errors(tmp_path, tiny_data, capsys):
    path = write_sweep(tmp_path, tiny_data)
    assert main(["tune", "--config", str(path), "--resume"]) == 2
    assert "no sweep to resume" in capsys.readouterr().err
    (tmp_path / "sweeps" / "tiny-sweep").mkdir(parents=True)
    (tmp_path / "sweeps" / "tiny-sweep" / "sweep.json").write_text("{}")
    assert main(["tune", "--config", str(path)]) == 2
    assert "pass --resume" in capsys.readouterr().err


def test_sweep_config_accepts_ranges_and_dry_run(tmp_path, tiny_data, capsys):
    path = write_sweep(tmp_path, tiny_data, search="random", space={
        "train.selector_alpha.end": {"low": 0.5, "high": 1.0}, "train.lr": {"low": 1e-4, "high": 1e-2, "log": True},
        "train.credit_floor": {"values": [0.05, 0.1]}, "train.native_anchor_fraction.end": {"low": 0.3, "high": 0.6}})  # fmt: skip
    assert main(["tune", "--config", str(path), "--dry-run"]) == 0
    assert "config OK" in capsys.readouterr().out
    assert not (tmp_path / "sweeps").exists()
