"""Ray Train end to end on a tiny target: drafter + DRelay selector jointly, DDP on 2 workers, a worker
killed mid-run, resume, MLflow.

Slow (Ray start-up dominates): ~2–3 minutes on 2 cores.
"""

from __future__ import annotations

import json

import pytest
import torch

from drelay_model.decoding import GenerationConfig, SpeculativeEngine
from drelay_model.drafter import load_drafter
from drelay_model.target import tiny_target
from pipelines.train.config import load_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """Prompt + the tiny target's own greedy continuation, as a tokenized training file."""
    target = tiny_target("tiny-llama")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, target.vocab_size, (8,), generator=g).tolist() for _ in range(64)]
    outs = SpeculativeEngine(target).generate(prompts, GenerationConfig(max_new_tokens=32)).tokens
    path = tmp_path_factory.mktemp("data") / "tiny.jsonl"
    path.write_text(
        "".join(
            json.dumps({"seq_id": f"s{i}", "input_ids": p + o, "response_start": 8}) + "\n"
            for i, (p, o) in enumerate(zip(prompts, outs))
        )
    )
    return path


def _config(tmp_path, data, **over):
    base = {
        "target.spec": "tiny-llama",
        "data.regenerated": str(data),
        "data.validation_fraction": 0.1,
        "train.max_steps": 16,
        "train.checkpoint_every": 4,
        "train.validate_every": 6,
        "train.seqs_per_step": 4,
        "train.anchors_per_seq": 8,
        "train.validation_prompts": 2,
        "train.warmup_steps": 2,
        "ray.num_workers": 2,
        "ray.storage_path": str(tmp_path / "ray"),
        "ray.run_name": "tiny",
        "output_dir": str(tmp_path / "out"),
        "drafter.num_layers": 1,
        "drafter.top_k": 8,
        "selector.name": "drelay",
        "selector.config": "{d_sel: 32, read_dim: 32, compact_dim: 16, history_len: 8}",
    }
    base.update(over)
    return load_config(None, [f"{k}={v}" for k, v in base.items()])


@pytest.mark.heavy  # a fault test (~2 min here): `make test-heavy`
def test_killed_worker_resumes_from_checkpoint_and_history_is_whole(tmp_path, tiny_data, ray_session, monkeypatch):
    from pipelines.common.tracking import get_client
    from pipelines.train.driver import run_training

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    marker = tmp_path / "killed"
    cfg = _config(tmp_path, tiny_data)
    result = run_training(cfg, extra_worker_config={"_kill_worker": {"rank": 1, "step": 10, "marker": str(marker)}})

    assert marker.read_text() == "10"  # the worker really was SIGKILLed at step 10
    drafter, _, meta = load_drafter(result.checkpoint, tiny_target("tiny-llama"))
    assert meta["step"] == 16 and result.metrics["step"] == 16
    client = get_client()
    run = client.get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(result.mlflow_run_id, "loss/support")
    assert {m.step for m in history} == set(range(1, 17))  # every step logged, before and after the kill
    assert {"val/tau_native", "val/tau_oracle", "val/tau_selector", "loss/selector"} <= run.data.metrics.keys()
    # Validation on its own schedule (every 6 steps and at the end), not only where a checkpoint falls.
    assert {m.step for m in client.get_metric_history(result.mlflow_run_id, "val/tau_native")} == {6, 12, 16}
    # The exported checkpoint carries the trained selector, loadable by name.
    from drelay_model.selectors import default_registry

    _, extra, meta = load_drafter(result.checkpoint, tiny_target("tiny-llama"))
    selector = default_registry().from_checkpoint("drelay", drafter=drafter, tensors=extra, meta=meta)
    assert selector.capabilities.history_len == 8

    # Same run name and storage: a longer schedule continues from step 16 instead of restarting.
    longer = _config(tmp_path, tiny_data, **{"train.max_steps": 20})
    again = run_training(longer)
    steps = {m.step for m in client.get_metric_history(again.mlflow_run_id, "loss/support")}
    assert steps == set(range(17, 21))
    assert load_drafter(again.checkpoint, tiny_target("tiny-llama"))[2]["step"] == 20


def test_a_run_whose_ray_checkpoints_are_gone_continues_from_its_snapshot(tmp_path, tiny_data, ray_session, monkeypatch):
    """A fresh machine has the committed snapshot and not outputs/ray: the same command, with a longer
    schedule, continues at the snapshot's step from its weights, re-warming a fresh optimizer."""
    import shutil

    from pipelines.common.tracking import get_client
    from pipelines.train.driver import run_training
    from pipelines.train.snapshot import SNAPSHOT_DTYPE

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    over = {"ray.num_workers": 1, "train.max_steps": 6, "train.checkpoint_every": 3, "train.validate_every": 100,
            "train.snapshot_dir": str(tmp_path / "snapshot"), "train.warmup_steps": 4}  # fmt: skip
    first = run_training(_config(tmp_path, tiny_data, **over))
    _, extra, meta = load_drafter(tmp_path / "snapshot", tiny_target("tiny-llama"))
    assert meta["snapshot"] and meta["step"] == 6 and meta["run_name"] == "tiny" and meta["selector"]["name"] == "drelay"
    assert extra and all(v.dtype == SNAPSHOT_DTYPE for v in extra.values() if v.is_floating_point())
    exported, _, _ = load_drafter(first.checkpoint, tiny_target("tiny-llama"))
    snap, _, _ = load_drafter(tmp_path / "snapshot", tiny_target("tiny-llama"))
    for (name, a), (_, b) in zip(exported.state_dict().items(), snap.state_dict().items()):
        assert torch.equal(a.to(SNAPSHOT_DTYPE).to(a.dtype) if a.is_floating_point() else a, b), name

    from pipelines.train.resume import RAY_CHECKPOINT, SNAPSHOT, resume_point

    longer = _config(tmp_path, tiny_data, **{**over, "train.max_steps": 9})
    point = resume_point(longer)  # what `drelay study --dry-run` says of it
    assert (point.source, point.step) == (RAY_CHECKPOINT, 6)
    assert point.describe(longer).startswith("continues from its Ray checkpoint at step 6")
    shutil.rmtree(tmp_path / "ray")  # what a fresh machine lacks
    assert (resume_point(longer).source, resume_point(longer).step) == (SNAPSHOT, 6)
    again = run_training(longer)
    client = get_client()
    assert {m.step for m in client.get_metric_history(again.mlflow_run_id, "loss/support")} == {7, 8, 9}
    lr = {m.step: m.value for m in client.get_metric_history(again.mlflow_run_id, "lr")}
    from drelay_model.training.schedules import lr_at

    # A fresh optimizer, re-warmed over 4 steps from the snapshot's step 6: the schedule's rate × 1/4, 2/4, 3/4.
    t = longer.train
    assert [lr[k] for k in (7, 8, 9)] == pytest.approx(
        [lr_at(k - 1, base=t.lr, warmup=4, total=9) * (k - 6) / 4 for k in (7, 8, 9)]
    )
    assert load_drafter(again.checkpoint, tiny_target("tiny-llama"))[2]["step"] == 9
    assert load_drafter(tmp_path / "snapshot", tiny_target("tiny-llama"))[2]["step"] == 9


def test_bad_inputs_fail_before_ray_starts(tmp_path, tiny_data):
    from drelay_model.errors import DRelayError
    from pipelines.train.driver import check_inputs

    with pytest.raises(DRelayError, match="data.regenerated: training data file .* not found"):
        check_inputs(_config(tmp_path, tmp_path / "missing.jsonl"))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(DRelayError, match="output_dir: cannot create"):
        check_inputs(_config(tmp_path, tiny_data, output_dir=str(blocker / "sub")))
    with pytest.raises(DRelayError, match="drafter.init_checkpoint: checkpoint .* not found"):
        check_inputs(_config(tmp_path, tiny_data, **{"drafter.init_checkpoint": str(tmp_path / "nope")}))


def test_study_trains_stages_compares_and_ships(tmp_path, tiny_data, ray_session, uri, monkeypatch, capsys):
    """`drelay study`: a base run, two runs started from it, the replay comparison, the shipped copy;
    a rerun trains nothing."""
    import yaml

    from drelay_model.selectors import default_registry
    from cli import main
    from pipelines.common.tracking import get_client

    monkeypatch.setattr("pipelines.common.paths.BUNDLED_CHECKPOINTS", tmp_path / "bundled")
    cfg = _config(tmp_path, tiny_data, **{"train.max_steps": 4, "train.validate_every": 4, "selector.name": "native"})
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    bench = tmp_path / "bench" / "gsm8k" / "test.jsonl"
    bench.parent.mkdir(parents=True)
    bench.write_text(json.dumps({"question": "one two three four five"}) + "\n")
    spec = {
        "name": "tiny-study",
        "stages": [
            {"config": str(base), "runs": {"base": []}},
            # The base run trains DDP on 2 workers; the runs started from it need no second worker.
            {"config": str(base), "overrides": ["drafter.init_checkpoint={base}", "train.max_steps=2", "train.checkpoint_every=2",
                                                "ray.num_workers=1"],
             "runs": {"native": [], "drelay": ["selector.name=drelay", "selector.config={d_sel: 32, read_dim: 32, history_len: 8}"]}},
        ],
        "compare": {"baseline": "native", "variants": {"pick": "drelay:native"}, "benchmarks": "gsm8k", "limit": 1,
                    "max_new_tokens": 8, "data_dir": str(tmp_path / "bench"), "out": str(tmp_path / "cmp")},
        "ship": "drelay",
    }  # fmt: skip
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    assert main(["study", "--spec", str(path), "--no-progress"]) == 0
    metrics = json.loads((tmp_path / "cmp" / "compare.json").read_text())["metrics"]
    assert list(metrics) == ["native", "drelay", "pick"]
    assert metrics["drelay"]["gsm8k/tau"] >= 1.0 and metrics["native"]["ratio_vs_baseline"] == 1.0
    target = tiny_target("tiny-llama")
    drafter, extra, meta = load_drafter(tmp_path / "bundled" / "tiny-llama", target)
    assert meta["step"] == 2 and meta["run_name"] == "tiny-study-drelay"
    default_registry().from_checkpoint("drelay", drafter=drafter, tensors=extra, meta=meta)
    runs = {
        r.info.run_name: r for r in get_client().search_runs([get_client().get_experiment_by_name("drelay-train").experiment_id])
    }
    assert {"tiny-study-base", "tiny-study-native", "tiny-study-drelay"} <= set(runs)
    # The study is a parent run (kind `study`); its training runs and the comparison nest under it.
    from pipelines.common.tracking import PARENT_TAG

    study = runs["tiny-study"]
    assert study.data.tags["drelay.kind"] == "study" and study.info.status == "FINISHED"
    children = {r.info.run_name: r for r in runs.values() if r.data.tags.get(PARENT_TAG) == study.info.run_id}
    assert {"tiny-study-base", "tiny-study-native", "tiny-study-drelay"} <= set(children)
    assert any(r.data.tags.get("drelay.kind") == "compare" for r in children.values())
    # A run that continues a checkpoint logs its starting point: validation at step 0, 0 budget minutes.
    history = get_client().get_metric_history(runs["tiny-study-native"].info.run_id, "val/tau_native")
    assert 0 in {m.step for m in history} and {m.step for m in history} > {0}
    tf = get_client().get_metric_history(runs["tiny-study-native"].info.run_id, "val/tf_accept")
    assert {m.step for m in tf} == {m.step for m in history}  # teacher-forced held-out metrics beside τ
    assert 0 not in {m.step for m in get_client().get_metric_history(runs["tiny-study-base"].info.run_id, "val/tau_native")}

    capsys.readouterr()
    assert main(["study", "--spec", str(path), "--no-progress", "--no-compare"]) == 0
    out = capsys.readouterr().out
    assert "training" not in out and out.count("— done") == 3
