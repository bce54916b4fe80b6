"""Schedules that end where the run ends: a time-budgeted run's learning rate reaches its floor when
the budget runs out, and an early-stopped selector-stage run cools down (every ramp at its end, the
rate falling linearly to its floor) before it exports."""

from __future__ import annotations

import pytest

from drelay_model.errors import DRelayError
from drelay_model.training.schedules import LR_FLOOR, lr_at, lr_cooldown
from pipelines.train import clock as clocks
from pipelines.train.config import load_config
from pipelines.train.cooldown import Cooldown, cooldown_length
from pipelines.train.selector_stage import _schedule

STAGE = ["drafter.init_checkpoint=x", "drafter.freeze=true", "selector.name=dflash2", "train.stage=selector",
         "train.scout_policy=native"]  # fmt: skip


def _run_budgeted(monkeypatch, cfg, seconds_per_step: float) -> list[float]:
    """The learning rates a run on `cfg` steps through until its clock ends it (fake wall seconds)."""
    now = [0.0]
    monkeypatch.setitem(clocks.CLOCKS, "wall", lambda: now[0])
    clock = clocks.TrainClock(cfg.train.max_minutes, cfg.train.max_steps)
    clock.restart()
    lrs = []
    for step in range(cfg.train.max_steps):
        lrs.append(_schedule(cfg, clock, None, step)[1])
        now[0] += seconds_per_step
        clock.tick(world=1)
        if clock.spent_all(1):
            break
    return lrs


def test_a_budgeted_run_ends_its_lr_decay_at_the_budget(monkeypatch):
    cfg = load_config(None, [*STAGE, "train.max_steps=100000", "train.max_minutes=1", "train.warmup_steps=5", "train.lr=1e-3"])
    lrs = _run_budgeted(monkeypatch, cfg, seconds_per_step=0.5)  # 120 steps fit the minute
    assert len(lrs) == 120
    assert lrs[0] == pytest.approx(1e-3 / 5)  # warm-up, then the decay follows the budget's share
    assert lrs[60] == pytest.approx(lr_at(50_000, base=1e-3, warmup=5, total=100_000), rel=1e-3)  # half the budget
    assert lrs[-1] == pytest.approx(LR_FLOOR * 1e-3, rel=1e-2)  # the last step in budget: at the floor, within a step
    assert all(a >= b for a, b in zip(lrs[5:], lrs[6:]))


def test_cooldown_length_default_configured_and_truncated():
    assert cooldown_length(None, steps_run=500, steps_left=2500) == 50  # a tenth of the steps run
    assert cooldown_length(None, steps_run=3, steps_left=10) == 1  # at least one
    assert cooldown_length(30, steps_run=500, steps_left=2500) == 30
    assert cooldown_length(30, steps_run=500, steps_left=12) == 12  # never past the run's end
    assert cooldown_length(0, steps_run=500, steps_left=2500) == 0  # none: stop at once
    assert cooldown_length(None, steps_run=500, steps_left=0) == 0


def test_cooldown_rate_falls_linearly_to_the_floor_and_ramps_sit_at_their_ends():
    cfg = load_config(None, [*STAGE, "train.max_steps=3000", "train.lr=1e-3", "train.early_stop_patience=3"])
    cool = Cooldown(start=500, steps=4, lr_start=9e-4)
    clock = clocks.TrainClock(None, 3000)
    got = [_schedule(cfg, clock, cool, s) for s in range(500, 504)]
    assert [p for p, _ in got] == [1.0] * 4  # β, α, native share: their end values
    assert [lr for _, lr in got] == pytest.approx([9e-4 - 8e-4 * k / 4 for k in (1, 2, 3, 4)])
    assert got[-1][1] == pytest.approx(LR_FLOOR * 1e-3) and cool.ends_at(503) and not cool.ends_at(502)
    assert cfg.train.credit_blend.at(1.0) == 1.0 and cfg.train.credit_blend.at(500 / 3000) < 0.34
    assert lr_cooldown(1.0, start=5e-5, base=1e-3) == 5e-5  # a stop during warm-up: no rise to the floor
    assert Cooldown.from_dict(cool.to_dict()) == cool and Cooldown.from_dict(None) is None


def test_cooldown_under_a_budget_reaches_the_floor_when_the_budget_runs_out():
    # 60 s were left when the stop fired at 100 s spent; 10 steps by count, but time binds first.
    cool = Cooldown(start=200, steps=10, lr_start=1e-3, spent_start=100.0, budget_left=60.0)
    assert cool.fraction(200, 100.0) == pytest.approx(0.1)  # by steps
    assert cool.fraction(201, 145.0) == pytest.approx(0.75)  # by time
    assert cool.lr(202, 160.0, base=1e-3) == pytest.approx(LR_FLOOR * 1e-3)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.cooldown_steps=-1", *STAGE], "train.cooldown_steps"),
        ([*STAGE, "train.cooldown_steps=10"], "needs train.early_stop_patience"),
        (["train.cooldown_steps=10"], "only the selector stage"),
    ],
)
def test_cooldown_steps_is_validated(overrides, message):
    with pytest.raises(DRelayError, match=message):
        load_config(None, overrides)
    assert load_config(None, [*STAGE, "train.early_stop_patience=3", "train.cooldown_steps=0"]).train.cooldown_steps == 0


@pytest.mark.slow
def test_an_early_stopped_stage_run_cools_down_from_its_best_head(monkeypatch, tmp_path):
    """The selector stage's loop on a tiny target in this process (Ray Train's context, checkpoint
    and report stood in for; held-out τ scripted so the rule fires at step 4): the best head is
    restored, two cool-down steps train with every ramp at its end and the rate falling to its
    floor, and the run reports its end there, with the cool-down in the saved stage state."""
    import json

    import ray.train
    import torch

    from drelay_model.drafter import BlockDrafter, DrafterConfig, save_drafter
    from drelay_model.target import tiny_target
    from pipelines.train import selector_stage

    target = tiny_target("tiny-llama")
    torch.manual_seed(0)
    save_drafter(BlockDrafter(DrafterConfig.for_target(target, num_layers=1, top_k=8), target), tmp_path / "ck")
    g = torch.Generator().manual_seed(2)
    rows = [{"seq_id": f"r/{i}", "input_ids": torch.randint(1, 256, (30,), generator=g).tolist(), "response_start": 6}
            for i in range(12)]  # fmt: skip
    (tmp_path / "seqs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, [
        "target.spec=tiny-llama", f"drafter.init_checkpoint={tmp_path / 'ck'}", "drafter.freeze=true", "selector.name=dflash2",
        "selector.config={rank: 8}", "train.stage=selector", "train.scout_policy=native", "train.anchors_per_seq=8",
        "train.seqs_per_step=1", "train.max_steps=20", "train.warmup_steps=0", "train.lr=1e-2", "train.validate_every=2",
        "train.checkpoint_every=100", "train.validation_prompts=1", "train.early_stop_patience=1", "train.cooldown_steps=2",
        f"data.regenerated={tmp_path / 'seqs.jsonl'}", "data.validation_fraction=0.1", "data.block_cache_shard=4",
        f"data.block_cache_dir={tmp_path / 'bc'}",
    ])  # fmt: skip

    class OneWorker:
        def get_world_rank(self):
            return 0

        def get_world_size(self):
            return 1

    monkeypatch.setattr(ray.train, "get_context", lambda: OneWorker())
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: None)
    taus, heads, modules = iter([1.5, 1.4, 1.3]), [], []  # the first validation is the best one

    def snapshot():
        return {k: v.clone() for k, v in modules[0].selector.state_dict().items()}

    def scripted_validation(target, module, prompts, conts):
        modules.append(module)
        heads.append(snapshot())
        return {"val/tau": next(taus)}

    logged, reports, progress, cooldown_from = {}, [], [], []
    real_step_config = selector_stage.step_config

    def recording_step_config(cfg, p):
        if p == 1.0 and not cooldown_from:
            cooldown_from.append(snapshot())  # the head the cool-down's first step starts from
        progress.append(p)
        return real_step_config(cfg, p)

    monkeypatch.setattr(selector_stage, "_validate_selector", scripted_validation)
    monkeypatch.setattr(selector_stage, "_metric_logger", lambda cfg_dict: lambda metrics, step: logged.update({step: metrics}))
    monkeypatch.setattr(selector_stage, "_report", lambda metrics, *a, **kw: reports.append((a[3], a[5], kw["final"])))
    monkeypatch.setattr(selector_stage, "step_config", recording_step_config)
    selector_stage.selector_stage_loop(cfg.model_dump())

    assert sorted(logged) == list(range(7))  # the cache's figures at 0; the stop at step 4, two cool-down steps
    assert progress[4:] == [1.0, 1.0] and all(p < 0.25 for p in progress[:4])
    lrs = [logged[s]["lr"] for s in range(1, 7)]
    assert lrs[4:] == pytest.approx([lrs[3] - (lrs[3] - 1e-3) / 2, 1e-3])  # linear to LR_FLOOR × train.lr
    step, state, final = reports[-1]
    assert (step, final) == (6, True) and state["cooldown"] == {
        "start": 4, "steps": 2, "lr_start": lrs[3], "spent_start": pytest.approx(state["cooldown"]["spent_start"]),
        "budget_left": None,
    }  # fmt: skip
    assert logged[6]["val/stop_step"] == 4 and logged[6]["val/tau_best"] == 1.5 and logged[6]["val/best_step"] == 2
    best, at_stop, cooled = heads  # validated at steps 2 (the best), 4 (the stop) and 6 (the cool-down's last, exported)
    assert all(torch.equal(best[k], cooldown_from[0][k]) for k in best)  # the cool-down starts from the best head
    assert any(not torch.equal(best[k], at_stop[k]) for k in best) and any(not torch.equal(best[k], cooled[k]) for k in best)
