"""The long run's snapshot (pipelines/train/snapshot.py): the weights in bfloat16 with the step and
budget spent, read back into a fresh module; another run's snapshot and bad folders are one-line
errors before any cluster starts; a resumed optimizer is re-warmed. The Ray round trip (a run whose
Ray checkpoints are gone continues from it) is in test_train_ray.py."""

from __future__ import annotations

import json

import pytest
import torch

from drelay_model.drafter import BlockDrafter, DrafterConfig
from drelay_model.errors import DRelayError
from drelay_model.selectors import default_registry
from drelay_model.target import tiny_target
from drelay_model.training.step import DraftTrainModule
from pipelines.train.snapshot import check_snapshot, has_snapshot, restore_snapshot, rewarm, save_snapshot

SELECTOR = {"d_sel": 32, "read_dim": 32, "compact_dim": 16, "history_len": 8}


@pytest.fixture(scope="module")
def target():
    return tiny_target("tiny-llama")


def _module(target, seed: int, selector: bool = True) -> DraftTrainModule:
    torch.manual_seed(seed)
    drafter = BlockDrafter(DrafterConfig.for_target(target, num_layers=1, top_k=8), target)
    head = default_registry().create("drelay", drafter=drafter, config=SELECTOR) if selector else None
    return DraftTrainModule(drafter, head)


def test_a_snapshot_restores_the_weights_rounded_to_bfloat16_with_step_and_budget(tmp_path, target):
    trained, fresh = _module(target, 0), _module(target, 1)
    path = tmp_path / "snap"
    save_snapshot(path, trained, step=120, train_seconds=3600.25, run_name="long", selector={"name": "drelay"})
    assert has_snapshot(path)
    from safetensors import safe_open

    with safe_open(str(path / "drafter.safetensors"), "pt") as f:
        floats = [f.get_tensor(k).dtype for k in f.keys() if f.get_tensor(k).is_floating_point()]
    assert floats and set(floats) == {torch.bfloat16}  # half the bytes of the float32 weights
    step, seconds = restore_snapshot(path, fresh, target, run_name="long")
    assert (step, seconds) == (120, 3600.2)
    for (name, a), (_, b) in zip(trained.state_dict().items(), fresh.state_dict().items()):
        want = a.to(torch.bfloat16).to(a.dtype) if a.is_floating_point() else a
        assert torch.equal(b, want), name
    check_snapshot(path, run_name="long")  # the run's own snapshot passes the early check


def test_another_runs_or_a_broken_snapshot_is_a_one_line_error(tmp_path, target):
    path = tmp_path / "snap"
    check_snapshot(path, run_name="long")  # none yet: nothing to check
    save_snapshot(path, _module(target, 0), step=3, train_seconds=1.0, run_name="other", selector=None)
    for call in (
        lambda: check_snapshot(path, run_name="long"),
        lambda: restore_snapshot(path, _module(target, 1), target, run_name="long"),
    ):
        with pytest.raises(
            DRelayError, match=r"train.snapshot_dir: .* holds a snapshot of run 'other', not of ray.run_name='long'"
        ):
            call()
    save_snapshot(path, _module(target, 0, selector=False), step=3, train_seconds=1.0, run_name="long", selector=None)
    with pytest.raises(DRelayError, match="holds no selector weights"):
        restore_snapshot(path, _module(target, 1), target, run_name="long")
    (path / "drafter_config.json").write_text("{not json")
    with pytest.raises(DRelayError, match=r"train.snapshot_dir: checkpoint .* is corrupted"):
        check_snapshot(path, run_name="long")
    doc = {
        "drafter": DrafterConfig.for_target(target, num_layers=2, top_k=8).to_dict(),
        "meta": {"snapshot": True, "run_name": "long"},
    }
    (path / "drafter_config.json").write_text(json.dumps(doc))
    with pytest.raises(DRelayError, match="train.snapshot_dir"):  # a 2-layer config over 1-layer weights
        restore_snapshot(path, _module(target, 1), target, run_name="long")


def test_the_rate_is_rewarmed_from_the_resume_only():
    assert rewarm(1e-3, step=50, resumed_at=None, warmup=10) == 1e-3
    assert [rewarm(1.0, step=s, resumed_at=40, warmup=4) for s in range(40, 46)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert rewarm(1.0, step=40, resumed_at=40, warmup=0) == 1.0


def test_the_config_checks_the_snapshot_folder_before_ray_starts(tmp_path):
    from pipelines.train.config import load_config
    from pipelines.train.driver import check_inputs

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"seq_id": "a", "input_ids": list(range(40)), "response_start": 8}) + "\n")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    base = [
        f"data.regenerated={data}",
        "target.spec=tiny-llama",
        f"output_dir={tmp_path / 'out'}",
        f"ray.storage_path={tmp_path / 'ray'}",
    ]
    with pytest.raises(DRelayError, match="train.snapshot_dir: cannot create"):
        check_inputs(load_config(None, [*base, f"train.snapshot_dir={blocker / 'sub' / 'snap'}"]))
    save_snapshot(tmp_path / "snap", _module(tiny_target("tiny-llama"), 0), step=1, train_seconds=0, run_name="x", selector=None)
    with pytest.raises(DRelayError, match="not of ray.run_name="):
        check_inputs(load_config(None, [*base, f"train.snapshot_dir={tmp_path / 'snap'}"]))
