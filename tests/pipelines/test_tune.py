"""`drelay tune` on a tiny target: real Ray Tune + Ray Train trials, ASHA, MLflow nesting, best config,
and the sweep config's one-line errors (which need no Ray)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from drelay_model.decoding import GenerationConfig, SpeculativeEngine
from drelay_model.target import tiny_target
from cli import main


def tiny_data_file(path: Path) -> Path:
    """Prompt + the tiny target's own greedy continuation, as a tokenized training file."""
    target = tiny_target("tiny-llama")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, target.vocab_size, (8,), generator=g).tolist() for _ in range(48)]
    outs = SpeculativeEngine(target).generate(prompts, GenerationConfig(max_new_tokens=24)).tokens
    path.write_text(
        "".join(
            json.dumps({"seq_id": f"s{i}", "input_ids": p + o, "response_start": 8}) + "\n"
            for i, (p, o) in enumerate(zip(prompts, outs))
        )
    )
    return path


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    return tiny_data_file(tmp_path_factory.mktemp("data") / "tiny.jsonl")


def base_config(data: Path, **over) -> dict:
    doc = {
        "target": {"spec": "tiny-llama"},
        "drafter": {"num_layers": 1, "top_k": 8},
        "data": {"regenerated": str(data), "validation_fraction": 0.1},
        "train": {"max_steps": 12, "checkpoint_every": 3, "validate_every": 3, "seqs_per_step": 4, "anchors_per_seq": 8,
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
        "space": {"train.lr": {"values": [1.0e-2, 1.0e-7]}, "train.credit_cap": {"values": [2.0, 4.0, 8.0]}},
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
    (
        {"space": {"train.credit_floor": {"low": 0.5, "high": 1.5}}},
        "space.train.credit_floor: train.credit_floor: Input should be less than or equal to 1",
    ),
    (
        {"space": {"train.credit_cap": {"values": [0.5, 4.0]}}},
        "space.train.credit_cap: train.credit_cap: Input should be greater than or equal to 1",
    ),
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


@pytest.mark.slow
def test_sweep_trials_asha_mlflow_best_config(tmp_path, tiny_data, ray_session, uri):
    """Two grid trials, one after the other (lr 1e-2, then lr 1e-7, which cannot learn): ASHA stops the
    second at its first rung against the first's recorded value, every trial is a nested MLflow run under
    the sweep's parent, the best config loads as a training config.

    Run one at a time, the first trial reaches every rung before the second starts, so which trial ASHA
    stops does not depend on the scheduling of concurrent trials. A trial's time is mostly its Ray Train
    start-up (its 12 tiny steps take about a second), so two trials keep the test short."""
    from pipelines.train.config import load_config
    from pipelines.common.tracking import PARENT_TAG, get_client

    # A 12-step tiny drafter's τ barely moves; its training loss separates the trials clearly.
    space = {"train.lr": {"values": [1.0e-2, 1.0e-7]}, "train.credit_cap": {"values": [4.0]}}
    path = write_sweep(tmp_path, tiny_data, space=space, metric="loss/support", mode="min", max_concurrent_trials=1)
    assert main(["tune", "--config", str(path)]) == 0
    folder = tmp_path / "sweeps" / "tiny-sweep"
    rows = list(__import__("csv").DictReader((folder / "trials.csv").open()))
    assert len(rows) == 2
    statuses = {r["trial_id"]: r["status"] for r in rows}
    assert "stopped early" in statuses.values(), statuses
    assert all(int(r["steps"]) < 12 for r in rows if r["status"] == "stopped early")

    client = get_client()
    parent_id = json.loads((folder / "sweep.json").read_text())["parent_run_id"]
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED"
    children = client.search_runs([parent.info.experiment_id], f"tags.`{PARENT_TAG}` = '{parent_id}'")
    assert sorted(c.info.run_name for c in children) == sorted(r["run_name"] for r in rows)
    for child in children:
        assert child.data.tags["drelay.checkpoint"].startswith("file://")
        assert child.info.status == ("FINISHED" if statuses[child.data.tags["drelay.trial_id"]] == "completed" else "KILLED")
        assert "train.lr" in child.data.params and "train.credit_cap" in child.data.params
        assert len(client.get_metric_history(child.info.run_id, "val/tau")) >= 1
        assert len(client.get_metric_history(child.info.run_id, "val/tau_ci_low")) >= 1  # its interval beside it
    best = next(r for r in rows if r["trial_id"] == parent.data.tags["best_trial_id"])
    assert best["status"] == "completed" and float(best["train.lr"]) == 1e-2
    artifacts = {a.path for a in client.list_artifacts(parent_id)}
    assert {"trials.csv", "trials.json", "parallel_coordinates.png", "metric_vs_params.png", "best.yaml"} <= artifacts

    # The stopped trial's Ray Train worker CPU is given back by the time `drelay tune` returns: the
    # suite's Ray instance has no dashboard, so Ray Train's own cleaner cannot free it, only the sweep
    # driver (a few seconds' grace for Ray's resource view to catch up).
    import time

    import ray

    deadline = time.time() + 5
    while ray.available_resources().get("CPU", 0) < 4 and time.time() < deadline:
        time.sleep(1)
    assert ray.available_resources().get("CPU", 0) == 4

    cfg = load_config(folder / "best.yaml")
    assert cfg.train.lr == 1e-2 and cfg.train.credit_cap == float(best["train.credit_cap"])
    assert cfg.ray.run_name == "tiny-sweep-best" and cfg.train.max_steps == 12


@pytest.mark.slow
@pytest.mark.heavy
def test_killed_sweep_resumes_without_rerunning_finished_trials(tmp_path, tiny_data, ray_session, uri):
    """SIGKILL the `drelay tune` process group once a trial has finished and the next is past its first
    checkpoint, then `--resume`: the sweep completes under the same parent run, no finished trial trains
    again, and the interrupted one continues from its checkpoint."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from pipelines.common.tracking import PARENT_TAG, get_client

    base = base_config(tiny_data, **{"train.max_steps": 12})
    path = write_sweep(tmp_path, tiny_data, base=base, space={"train.lr": {"values": [1e-2, 5e-3, 2e-3]}},
                       scheduler={"name": "fifo"}, max_concurrent_trials=1)  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "TUNE_GLOBAL_CHECKPOINT_S": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "cli", "tune", "--config", str(path)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    client, folder = get_client(), tmp_path / "sweeps" / "tiny-sweep"

    def nested(status: str):
        exp = client.get_experiment_by_name("drelay-tune")
        query = f"attributes.status = '{status}' and tags.`{PARENT_TAG}` != ''"
        return client.search_runs([exp.experiment_id], query) if exp is not None else []

    try:
        deadline, ready = time.time() + 600, False
        while not ready and time.time() < deadline and proc.poll() is None:
            time.sleep(1)
            steps = [max((m.step for m in client.get_metric_history(r.info.run_id, "loss/support")), default=0)
                     for r in nested("RUNNING")]  # fmt: skip
            ready = bool(nested("FINISHED")) and any(4 <= s <= 10 for s in steps)  # past the step-3 checkpoint
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert ready, "the sweep did not reach a finished trial and a running one in time"
    finished = {r.info.run_name for r in nested("FINISHED")}
    interrupted = {r.info.run_name for r in nested("RUNNING")}
    parent_id = json.loads((folder / "sweep.json").read_text())["parent_run_id"]

    assert main(["tune", "--config", str(path), "--resume"]) == 0
    rows = list(__import__("csv").DictReader((folder / "trials.csv").open()))
    assert len(rows) == 3 and all(r["status"] == "completed" for r in rows), rows
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["best_trial_id"] in {r["trial_id"] for r in rows}
    children = sorted(client.search_runs([parent.info.experiment_id], f"tags.`{PARENT_TAG}` = '{parent_id}'"),
                      key=lambda r: r.info.start_time)  # fmt: skip
    attempts: dict[str, list] = {}
    for child in children:
        attempts.setdefault(child.info.run_name, []).append(child)
    assert len(attempts) == 3 and all(a[-1].info.status == "FINISHED" for a in attempts.values())
    for name in finished:  # trained once, never again
        assert [a.info.status for a in attempts[name]] == ["FINISHED"]
    for name in interrupted:  # the killed attempt, then one that continued from its checkpoint
        assert [a.info.status for a in attempts[name]] == ["FAILED", "FINISHED"]
        resumed = {m.step for m in client.get_metric_history(attempts[name][-1].info.run_id, "loss/support")}
        assert min(resumed) > 3 and max(resumed) == 12, sorted(resumed)


@pytest.mark.parametrize("path", sorted(Path("platform/sweeps").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_sweeps_validate(path, capsys):
    assert main(["tune", "--config", str(path), "--dry-run"]) == 0
    assert "config OK" in capsys.readouterr().out


def test_a_trial_larger_than_the_cluster_is_refused(tmp_path, tiny_data, monkeypatch, capsys):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # a 2-CPU cluster, without starting one
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    path = write_sweep(tmp_path, tiny_data, resources={"num_workers": 1, "cpus_per_worker": 2})
    assert main(["tune", "--config", str(path)]) == 2
    assert (
        "resources: a trial needs 2.1 CPUs (driver_cpu 0.1 + 1 workers × 2) but the Ray cluster has 2" in capsys.readouterr().err
    )
    assert not (tmp_path / "sweeps" / "tiny-sweep" / "sweep.json").exists()


def test_a_sweep_that_continues_a_checkpoint_must_not_warm_up(tmp_path, tiny_data, capsys):
    """The shipped sweep's failure: trials that warm up to a fresh peak rate from a checkpoint."""
    base = base_config(tiny_data, **{"drafter.init_checkpoint": "checkpoints/smollm2-135m"})
    for over in ({"base": base}, {"base": {**base, "train": {**base["train"], "warmup_steps": 0}},
                                  "space": {"train.warmup_steps": {"values": [0, 5]}}}):  # fmt: skip
        assert main(["tune", "--config", str(write_sweep(tmp_path, tiny_data, **over))]) == 2
        err = capsys.readouterr().err.strip()
        assert "overrides: train.warmup_steps must be 0" in err and "\n" not in err, err
    ok = {"base": {**base, "train": {**base["train"], "warmup_steps": 0}}}
    assert main(["tune", "--config", str(write_sweep(tmp_path, tiny_data, **ok)), "--dry-run"]) == 0


@pytest.mark.parametrize("name", ["smollm2-135m", "smollm2-135m-quick", "smollm2-135m-smoke"])
def test_shipped_sweeps_train_on_at_the_bundled_runs_decayed_rate(name):
    """The bundled `joint-full` run: peak 2e-4, 30 warm-up steps, cosine to 10% over 700 steps; its last
    step (699) ran at 2e-4 · (0.1 + 0.45 · (1 + cos(π · 669/670))) ≈ 2.0e-5. The sweeps start there,
    without warm-up."""
    import math

    from pipelines.tune.config import load_sweep

    root = Path(__file__).resolve().parents[2]
    _, base = load_sweep(root / f"platform/sweeps/{name}.yaml")
    last = 2e-4 * (0.1 + 0.45 * (1 + math.cos(math.pi * 669 / 670)))
    assert base["train"]["warmup_steps"] == 0 and base["train"]["lr"] == pytest.approx(last, rel=1e-3)


def test_shipped_sweep_is_valid_and_holds_the_shipped_setting():
    from pipelines.tune.config import load_sweep

    root = Path(__file__).resolve().parents[2]
    sweep, base = load_sweep(root / "platform/sweeps/smollm2-135m.yaml")
    assert set(sweep.space) == {"train.selector_alpha.end", "train.credit_cap", "train.credit_floor"}
    assert base["drafter"]["init_checkpoint"] == "checkpoints/smollm2-135m@f3a1e833b2" and base["selector"]["name"] == "drelay"
    assert 1.0 in sweep.space["train.selector_alpha.end"].values and 4.0 in sweep.space["train.credit_cap"].values
    assert 0.1 in sweep.space["train.credit_floor"].values  # the bundled run's values: the control trial
    assert sweep.scheduler.max_steps <= 100 and sweep.metric == "val/tau"


def test_trials_get_their_own_names_folders_and_values(tmp_path, tiny_data):
    from pipelines.tune.config import load_sweep
    from pipelines.tune.report import COMPLETED, STOPPED, best_row
    from pipelines.tune.trial import context_for, trial_config

    sweep, base = load_sweep(write_sweep(tmp_path, tiny_data))
    ctx = context_for(sweep, base, tmp_path / "s", parent_run_id="p", tracking_uri="sqlite:///x.db")
    a = trial_config(ctx, {"train.lr": 1e-2, "train.credit_cap": 8.0}, "abc_00000")
    b = trial_config(ctx, {"train.lr": 1e-7, "train.credit_cap": 2.0}, "abc_00001")
    assert (a.ray.run_name, b.ray.run_name) == ("tiny-sweep-abc-00000", "tiny-sweep-abc-00001")
    assert a.train.lr == 1e-2 and a.train.credit_cap == 8.0 and b.train.credit_cap == 2.0
    assert a.ray.storage_path == b.ray.storage_path == str(tmp_path / "s" / "train")  # Ray keys runs by name
    assert a.mlflow.tracking_uri == "sqlite:///x.db" and a.train.max_steps == 12
    rows = [{"status": STOPPED, "m": 3.0}, {"status": COMPLETED, "m": 2.0}, {"status": COMPLETED, "m": float("nan")}]
    assert best_row(rows, "m", "max") is rows[1]  # a completed trial beats one stopped at a rung
    assert best_row([{"status": STOPPED, "m": 1.0}, {"status": STOPPED, "m": 2.0}], "m", "min")["m"] == 1.0


def test_search_spaces_map_to_tune_domains(tmp_path, tiny_data):
    from ray.tune.search.optuna import OptunaSearch
    from ray.tune.search.sample import Categorical, Float

    from pipelines.tune.config import load_sweep
    from pipelines.tune.runner import _tune_config, search_space

    space = {"train.lr": {"low": 1e-4, "high": 1e-2, "log": True}, "train.credit_cap": {"values": [2.0, 4.0]}}
    sweep, _ = load_sweep(write_sweep(tmp_path, tiny_data, search="optuna", space=space, max_concurrent_trials=3))
    params = search_space(sweep)["params"]
    assert isinstance(params["train.lr"], Float) and params["train.lr"].lower == 1e-4
    assert isinstance(params["train.credit_cap"], Categorical) and params["train.credit_cap"].categories == [2.0, 4.0]
    tc = _tune_config(sweep, 12)
    assert isinstance(tc.search_alg, OptunaSearch) and tc.max_concurrent_trials == 3 and tc.metric == "val/tau"
    grid, _ = load_sweep(write_sweep(tmp_path, tiny_data))
    assert search_space(grid)["params"]["train.lr"] == {"grid_search": [1e-2, 1e-7]}


@pytest.mark.parametrize("name", ["smollm2-135m", "smollm2-135m-quick", "smollm2-135m-smoke"])
def test_every_shipped_sweep_loads_and_fits_two_cores(name):
    from pipelines.train.config import RunConfig
    from pipelines.tune.config import load_sweep

    sweep, base = load_sweep(Path(__file__).resolve().parents[2] / f"platform/sweeps/{name}.yaml")
    cfg = RunConfig.model_validate(base)
    workers = sweep.resources.num_workers or cfg.ray.num_workers
    assert sweep.resources.driver_cpu + workers * (sweep.resources.cpus_per_worker or cfg.ray.cpus_per_worker) <= 2


def test_start_reference_measures_the_init_checkpoint_like_a_trial(tmp_path, tiny_data):
    """The `start` row: the base's init checkpoint through the trials' own validation (cached)."""
    from drelay_model.drafter import load_drafter
    from pipelines.train.config import RunConfig
    from pipelines.train.model_io import build_module, save_training_checkpoint
    from pipelines.train.worker import feature_source, held_out_set, load_data, training_precision, validate, validation_set
    from pipelines.tune.report import start_reference

    target = tiny_target("tiny-llama")
    doc = base_config(tiny_data, **{"drafter.draft_vocab_size": None})
    doc["selector"] = {"name": "drelay", "config": {"d_sel": 32, "read_dim": 32, "history_len": 8}}
    first = RunConfig.model_validate(doc)
    module = build_module(first, target, [])
    save_training_checkpoint(tmp_path / "ck", module, torch.optim.AdamW(module.parameters()), 3, first)
    base = RunConfig.model_validate({**doc, "drafter": {**doc["drafter"], "init_checkpoint": str(tmp_path / "ck" / "drafter")}})
    assert start_reference(RunConfig.model_validate(doc), tmp_path) is None  # nothing to start from
    got = start_reference(base, tmp_path)
    _, val = load_data(base, target)
    run = training_precision(base, torch.device("cpu"))  # the precision a CPU worker trains in (float32 without native bf16)
    module = build_module(run, target, [])
    again = validate(
        target, module, *validation_set(run, target, val), held_out_set(run, val, feature_source(run, target, module))
    )
    assert got == pytest.approx(again) and {"val/tau", "val/tau_selector", "val/tau_native"} <= set(got)
    assert {"val/tf_accept", "val/tf_acc_slot1", "val/tf_loss"} <= set(got)  # the trials' teacher-forced metrics too
    # val/tau's 95% interval over the validation prompts, around the pooled replay τ
    assert got["val/tau_ci_low"] <= got["val/tau"] <= got["val/tau_ci_high"]
    # the repair alone: the selector's τ over the same drafter's argmax path, paired by prompt
    assert got["val/repair_gain"] == pytest.approx(got["val/tau_selector"] / got["val/tau_native"])
    assert got["val/repair_gain_ci_low"] <= got["val/repair_gain"] <= got["val/repair_gain_ci_high"]
    assert json.loads((tmp_path / "start.json").read_text()) == got  # cached: a resumed sweep reads it back
    assert load_drafter(tmp_path / "ck" / "drafter", target)[2]["final"] is False


def test_selector_stage_sweeps_reach_into_the_selector_config_and_may_warm_up():
    """A swept path may go into the free-form selector.config (its owner checks the values when a trial
    builds), and a fresh head on a frozen drafter continues nothing, so its sweep may warm up."""
    from pipelines.common.paths import REPO_ROOT as ROOT
    from pipelines.tune.config import field_path_error, load_sweep

    assert field_path_error("selector.config.d_sel") is None
    assert "is a value" in field_path_error("train.lr.x")
    for name in ("smollm2-135m-selector-stage.yaml", "smollm2-135m-selector-stage-smoke.yaml"):
        sweep, base = load_sweep(ROOT / "platform/sweeps" / name)
        assert base["train"]["stage"] == "selector" and base["drafter"]["freeze"] and base["selector"]["fresh"]
    sweep, base = load_sweep(ROOT / "platform/sweeps/smollm2-135m-selector-stage.yaml")
    assert base["train"]["warmup_steps"] == 10 and len(sweep.space) == 5
