"""Training data: sequence files, regenerated conversations, splits, batches, the feature cache."""

from __future__ import annotations

import json

import pytest
import torch

from drelay_model.errors import DRelayError
from drelay_model.target import tiny_target
from pipelines.train.data import batch_order, collate, label_counts, read_sequences, split_validation
from pipelines.train.features import FeatureSource, target_features


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_tokenized_file_roundtrip_and_errors(tmp_path):
    path = _write(
        tmp_path / "d.jsonl",
        [
            {"seq_id": "a", "input_ids": [1, 2, 3, 4, 5], "response_start": 2},
            {"seq_id": "b", "input_ids": [1, 2], "response_start": 1},
        ],
    )
    seqs = read_sequences(path, max_seq_len=4)
    assert [s.seq_id for s in seqs] == ["a"] and seqs[0].input_ids == (1, 2, 3, 4)  # b has no room for an anchor
    with pytest.raises(DRelayError, match="not found"):
        read_sequences(tmp_path / "none.jsonl", max_seq_len=8)
    (tmp_path / "bad.jsonl").write_text('{"seq_id": 1}\n{oops\n')
    with pytest.raises(DRelayError, match="bad.jsonl:1: expected"):
        read_sequences(tmp_path / "bad.jsonl", max_seq_len=8)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DRelayError, match="no usable sequences"):
        read_sequences(tmp_path / "empty.jsonl", max_seq_len=8)


def test_regenerated_conversations_keep_the_exact_generated_ids(tmp_path, smol):
    rec = {
        "conv_id": "c1",
        "source": "test",
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"},
            {"role": "assistant", "content": "Bye!"},
        ],
        "turn_token_ids": [[9, 8, 7, 2], [6, 5, 2]],
        "finished": True,
    }
    seqs = read_sequences(
        _write(tmp_path / "r.jsonl", [rec, {"conv_id": "c2", "skipped": "prompt too long"}]), smol.tokenizer, max_seq_len=512
    )
    assert len(seqs) == 2
    assert seqs[0].input_ids[seqs[0].response_start :] == (9, 8, 7, 2)
    assert seqs[1].input_ids[seqs[1].response_start :] == (6, 5, 2)
    second_prompt = smol.tokenizer.decode(seqs[1].input_ids[: seqs[1].response_start])
    assert "Hello!" in second_prompt and second_prompt.rstrip().endswith("assistant")


def test_split_keeps_conversations_together_and_is_stable(tmp_path):
    rows = [{"seq_id": f"c{i // 2}#{i % 2}", "input_ids": list(range(6)), "response_start": 2} for i in range(400)]
    seqs = read_sequences(_write(tmp_path / "d.jsonl", rows), max_seq_len=16)
    train, val = split_validation(seqs, 0.1)
    assert 0 < len(val) < 80 and len(train) + len(val) == 400
    assert not {s.seq_id.split("#")[0] for s in val} & {s.seq_id.split("#")[0] for s in train}
    assert split_validation(seqs, 0.1)[1] == val


def test_batches_cover_every_sequence_once_per_epoch():
    lengths = [5 + (i * 7) % 30 for i in range(103)]
    batches = batch_order(103, lengths, 4, seed=1, epoch=0)
    assert sorted(i for b in batches for i in b) == list(range(103))
    assert batches == batch_order(103, lengths, 4, seed=1, epoch=0) != batch_order(103, lengths, 4, seed=1, epoch=1)


def test_collate_and_label_counts(tmp_path):
    seqs = read_sequences(
        _write(
            tmp_path / "d.jsonl",
            [
                {"seq_id": "a", "input_ids": [3, 4, 5], "response_start": 1},
                {"seq_id": "b", "input_ids": [3, 4, 4, 6], "response_start": 2},
            ],
        ),
        max_seq_len=8,
    )
    ids, mask = collate(seqs)
    assert ids.tolist() == [[3, 4, 5, 0], [3, 4, 4, 6]]
    assert mask.tolist() == [[False, True, True, False], [False, False, True, True]]
    assert label_counts(seqs, 8).tolist() == [0, 0, 0, 0, 2, 1, 1, 0]


def test_disk_feature_cache_matches_fresh_features_and_is_reused(tmp_path):
    target = tiny_target("tiny-llama")
    rows = [{"seq_id": f"s{i}", "input_ids": torch.randint(0, 256, (5 + i,)).tolist(), "response_start": 2} for i in range(4)]
    seqs = read_sequences(_write(tmp_path / "d.jsonl", rows), max_seq_len=32)
    layers = (0, 1)
    fresh = target_features(target, collate(seqs)[0], layers)
    source = FeatureSource(target, layers, tmp_path / "cache")
    first = source(seqs[:2])
    second = source(seqs)  # two hits, two misses
    assert (source.hits, source.misses) == (2, 4)
    for b, s in enumerate(seqs):
        n = len(s.input_ids)
        torch.testing.assert_close(second[b, :n], fresh[b, :n], atol=0.05, rtol=0.02)  # stored as bf16
        assert second[b, n:].abs().sum() == 0
    torch.testing.assert_close(first, second[:2, : first.shape[1]])
    assert len(list((tmp_path / "cache").rglob("*.pt"))) == 4


def test_bf16_features_are_close_to_float32_and_cached_apart(tmp_path):
    target = tiny_target("tiny-llama")
    rows = [{"seq_id": f"s{i}", "input_ids": torch.randint(0, 256, (6 + i,)).tolist(), "response_start": 2} for i in range(3)]
    seqs = read_sequences(_write(tmp_path / "d.jsonl", rows), max_seq_len=32)
    ids = collate(seqs)[0]
    fp32 = target_features(target, ids, (0, 1))
    bf16 = target_features(target, ids, (0, 1), bf16=True)
    assert not torch.equal(fp32, bf16)  # the autocast really ran
    assert float((fp32 - bf16).norm() / fp32.norm()) < 0.02
    FeatureSource(target, (0, 1), tmp_path / "cache")(seqs)
    FeatureSource(target, (0, 1), tmp_path / "cache", bf16=True)(seqs)
    assert len([d for d in (tmp_path / "cache").iterdir()]) == 2  # one cache per precision


def test_a_glob_reads_every_shard_once(tmp_path):
    _write(tmp_path / "t.jsonl", [{"seq_id": "a", "input_ids": [1, 2, 3], "response_start": 1}])
    _write(
        tmp_path / "t.shard-0-of-2.jsonl",
        [
            {"seq_id": "b", "input_ids": [1, 2, 3], "response_start": 1},
            {"seq_id": "a", "input_ids": [1, 2, 3], "response_start": 1},
        ],
    )
    assert sorted(s.seq_id for s in read_sequences(tmp_path / "t*.jsonl", max_seq_len=8)) == ["a", "b"]
    with pytest.raises(DRelayError, match="no training data file matches"):
        read_sequences(tmp_path / "u*.jsonl", max_seq_len=8)


def test_line_separators_inside_json_strings_do_not_split_a_record(tmp_path):
    rows = [
        {"seq_id": "a\u2028b\x85c", "input_ids": [1, 2, 3], "response_start": 1},
        {"seq_id": "d", "input_ids": [4, 5, 6], "response_start": 1},
    ]
    path = tmp_path / "u.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    assert [s.seq_id for s in read_sequences(path, max_seq_len=8)] == ["a\u2028b\x85c", "d"]


def test_a_torn_last_line_is_ignored_but_a_bad_middle_line_is_an_error(tmp_path):
    good = json.dumps({"seq_id": "a", "input_ids": [1, 2, 3], "response_start": 1})
    (tmp_path / "torn.jsonl").write_text(good + "\n" + '{"seq_id": "b", "input_ids": [1,')
    assert [s.seq_id for s in read_sequences(tmp_path / "torn.jsonl", max_seq_len=8)] == ["a"]
    (tmp_path / "bad.jsonl").write_text('{"seq_id": "b", "input_ids": [1,\n' + good + "\n")
    with pytest.raises(DRelayError, match="bad.jsonl:1: not valid JSON"):
        read_sequences(tmp_path / "bad.jsonl", max_seq_len=8)


def test_no_selector_loss_freezes_the_selector_at_its_native_initialisation():
    """Table 4's "No selector loss": the selector gets no gradient, so it must not be a DDP parameter."""
    from drelay_model.target import tiny_target
    from pipelines.train.config import load_config
    from pipelines.train.model_io import build_module

    target = tiny_target("tiny-llama")
    over = ["target.spec=tiny-llama", "drafter.num_layers=1", "drafter.top_k=8", "drafter.draft_vocab_size=null", "selector.name=drelay",
            "selector.config={d_sel: 32, read_dim: 32, history_len: 8}"]  # fmt: skip
    full = build_module(load_config(None, over), target, [])
    ablated = build_module(load_config(None, [*over, "train.selector_loss=false"]), target, [])
    assert all(p.requires_grad for p in full.selector.parameters())
    assert not any(p.requires_grad for p in ablated.selector.parameters())
    assert any(p.requires_grad for p in ablated.drafter.parameters())


def test_init_checkpoint_continues_its_trained_selector(tmp_path):
    """A longer joint run starts from drafter *and* selector of `drafter.init_checkpoint`; a fresh
    selector would throw away what the first run learned. A contradicting selector.config fails."""
    from drelay_model.target import tiny_target
    from pipelines.train.config import load_config
    from pipelines.train.driver import check_inputs
    from pipelines.train.model_io import build_module, save_training_checkpoint

    target = tiny_target("tiny-llama")
    small = "selector.config={d_sel: 32, read_dim: 32, history_len: 8}"
    over = [
        "target.spec=tiny-llama",
        "drafter.num_layers=1",
        "drafter.top_k=8",
        "drafter.draft_vocab_size=null",
        "selector.name=drelay",
    ]
    cfg = load_config(None, [*over, small])
    first = build_module(cfg, target, [])
    with torch.no_grad():
        for p in first.selector.parameters():
            p.add_(0.5)  # "trained": nothing like a fresh initialisation
    optimizer = torch.optim.AdamW([p for p in first.parameters() if p.requires_grad])
    save_training_checkpoint(tmp_path / "ck", first, optimizer, 7, cfg)
    init = f"drafter.init_checkpoint={tmp_path / 'ck' / 'drafter'}"

    second = build_module(load_config(None, [*over, init]), target, [])
    for (name, a), b in zip(first.selector.state_dict().items(), second.selector.state_dict().values()):
        assert torch.equal(a, b), name
    assert all(p.requires_grad for p in second.selector.parameters())
    assert build_module(load_config(None, [*over, small, init]), target, []).selector is not None  # same config: fine

    clash = load_config(None, [*over, init, "selector.config={d_sel: 64}", f"output_dir={tmp_path}/o", f"ray.storage_path={tmp_path}/r",
                               "data.fallback_reference_answers=true"])  # fmt: skip
    with pytest.raises(DRelayError, match=r"^selector.config: d_sel differs from the trained 'drelay' selector"):
        check_inputs(clash)
    fresh = load_config(None, [*over, init, "selector.fresh=true", "selector.config={d_sel: 64}", f"output_dir={tmp_path}/o",
                               f"ray.storage_path={tmp_path}/r", "data.fallback_reference_answers=true"])  # fmt: skip
    check_inputs(fresh)  # a fresh selector ignores the saved one: its config may differ
    assert build_module(fresh, target, []).selector.config.d_sel == 64
    native = build_module(load_config(None, [*over[:-1], init]), target, [])
    assert native.selector is None  # a native run from a joint checkpoint keeps the drafter only


def test_progress_line_prints_once_per_interval_and_at_the_end(capfd):
    from pipelines.train.clock import ProgressLine

    progress = ProgressLine(0, 60, every=25)
    for step in range(1, 61):
        progress.update(step, {"loss/support": 2.5, "acc/slot1": 0.4, **({"val/tau_native": 1.8} if step == 60 else {})})
    lines = [line for line in capfd.readouterr().out.splitlines() if line]
    assert [line.split(" · ")[0] for line in lines] == ["[train] step 25/60", "[train] step 50/60", "[train] step 60/60"]
    assert "support 2.500" in lines[0] and "slot-1 acc 0.400" in lines[0] and lines[-1].endswith("tau_native 1.800")


def test_progress_line_under_a_cpu_budget_gives_cpu_minutes_and_their_wall_minutes(capfd, monkeypatch):
    """CPU minutes left, and at the pace since the previous line (here 30 budget seconds per 60 wall
    seconds) the wall minutes they take."""
    from pipelines.train import clock

    now = [0.0]
    monkeypatch.setattr(clock.time, "perf_counter", lambda: now[0])
    progress = clock.ProgressLine(0, 1000, every=25, clock="cpu")
    for step, left_s in ((25, 600.0), (50, 570.0)):
        now[0] += 60.0
        progress.update(step, {"loss/support": 2.0}, budget_left_s=left_s)
    first, second = [line for line in capfd.readouterr().out.splitlines() if line]
    assert first.endswith("· 10.0 cpu min left")  # no pace yet
    assert second.endswith("· 9.5 cpu min left (~19 wall min at this pace)")


def test_train_clock_budget_drives_the_schedules_and_the_stop(monkeypatch):
    """`train.max_minutes`: progress is max(steps, time) fractions, validation time is not counted,
    the budget left survives a resume (the count is saved with the checkpoint)."""
    from pipelines.train import clock as worker

    now = [0.0]
    monkeypatch.setitem(worker.CLOCKS, "wall", lambda: now[0])
    clock = worker.TrainClock(max_minutes=1.0, max_steps=1000)  # 60 s or 1000 steps
    clock.restart()
    now[0] = 30.0
    clock.tick(world=1)
    assert clock.progress(10) == pytest.approx(0.5) and clock.schedule_step(10) == 500 and not clock.spent_all(1)
    clock.pause(20.0)  # a validation from t = 30 s to 50 s
    now[0] = 50.0
    clock.tick(world=1)
    assert clock.spent == pytest.approx(30.0)
    now[0] = 80.0
    clock.tick(world=1)
    assert clock.spent_all(1) and clock.progress(11) == 1.0 and clock.schedule_step(11) == 999
    steps_only = worker.TrainClock(max_minutes=None, max_steps=100)
    now[0] = 1e6
    steps_only.tick(world=1)
    assert steps_only.progress(25) == 0.25 and steps_only.schedule_step(25) == 25 and not steps_only.spent_all(1)


def test_cpu_budget_counts_the_process_cpu_time_and_checkpoints_follow_wall_minutes(monkeypatch):
    """`train.budget_clock: cpu` spends the budget on this process's CPU seconds (a busy machine that
    stalls the run costs it nothing); `train.checkpoint_minutes` makes a checkpoint due after that
    much wall time, and `checkpointed` starts the next interval."""
    from pipelines.train import clock as clocks

    cpu, wall = [0.0], [0.0]
    monkeypatch.setitem(clocks.CLOCKS, "cpu", lambda: cpu[0])
    monkeypatch.setattr(clocks.time, "perf_counter", lambda: wall[0])
    clock = clocks.TrainClock(max_minutes=1.0, max_steps=10_000, kind="cpu", checkpoint_minutes=10.0)
    clock.restart()
    cpu[0], wall[0] = 20.0, 300.0  # a step stalled by other work: 5 wall minutes, 20 CPU seconds
    clock.tick(world=1)
    assert clock.spent == pytest.approx(20.0) and not clock.checkpoint_due()
    with clock.paused():  # validation: 15 CPU seconds, not counted
        cpu[0] = 35.0
    cpu[0], wall[0] = 45.0, 601.0
    clock.tick(world=1)
    assert clock.spent == pytest.approx(30.0) and clock.checkpoint_due() and clock.progress(1) == pytest.approx(0.5)
    clock.checkpointed()
    cpu[0], wall[0] = 80.0, 700.0
    clock.tick(world=1)
    assert clock.spent_all(1) and not clock.checkpoint_due()
    with pytest.raises(ValueError, match="clock kind"):
        clocks.TrainClock(1.0, 10, kind="gpu")


def test_warm_up_counts_steps_taken_under_a_time_budget():
    """Under a budget the schedule's step follows the budget (max_steps · spent / budget) and runs far
    ahead of the optimizer steps taken; the warm-up still lasts `warmup` real steps."""
    from drelay_model.training.schedules import lr_at

    ahead = 40_000  # the schedule's step 40% into a 100,000-step, time-bound run, at real step 10
    assert lr_at(ahead, base=1.0, warmup=50, total=100_000, taken=10) == pytest.approx(11 / 50)
    assert lr_at(ahead, base=1.0, warmup=50, total=100_000, taken=60) == lr_at(ahead, base=1.0, warmup=50, total=100_000)
    assert lr_at(10, base=1.0, warmup=50, total=100) == lr_at(10, base=1.0, warmup=50, total=100, taken=10)


def test_training_falls_back_to_float32_where_bfloat16_is_not_native(monkeypatch, capfd):
    from pipelines.train import worker
    from pipelines.train.config import load_config

    cfg = load_config(None, ["train.bf16=true"])
    monkeypatch.setattr(worker, "bf16_native", lambda: False)
    got = worker.training_precision(cfg, torch.device("cpu"), announce=True)
    assert got.train.bf16 is False and cfg.train.bf16 is True and "training in float32" in capfd.readouterr().out
    monkeypatch.setattr(worker, "bf16_native", lambda: True)
    assert worker.training_precision(cfg, torch.device("cpu")) is cfg
    assert worker.training_precision(load_config(None, ["train.bf16=false"]), torch.device("cpu")).train.bf16 is False


def test_training_checkpoint_keeps_the_seconds_spent(tmp_path):
    from drelay_model.target import tiny_target
    from pipelines.train.config import load_config
    from pipelines.train.model_io import build_module, restore_training_checkpoint, save_training_checkpoint

    target = tiny_target("tiny-llama")
    cfg = load_config(
        None,
        [
            "target.spec=tiny-llama",
            "drafter.num_layers=1",
            "drafter.top_k=8",
            "drafter.draft_vocab_size=null",
            "train.max_minutes=2.5",
        ],
    )
    assert cfg.train.max_minutes == 2.5
    module = build_module(cfg, target, [])
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad])
    save_training_checkpoint(tmp_path / "ck", module, optimizer, 7, cfg, train_seconds=42.5)
    assert restore_training_checkpoint(tmp_path / "ck", module, optimizer, target) == (7, 42.5)


def test_soft_labels_are_the_targets_top_k_at_each_response_position(tmp_path):
    from pipelines.train.features import target_outputs

    target = tiny_target("tiny-llama")
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    response = torch.zeros(2, 12, dtype=torch.bool)
    response[0, 4:], response[1, 7:10] = True, True
    got = target_outputs(target, ids, response, (0, 1), top_k=5)
    torch.testing.assert_close(got.features, target_features(target, ids, (0, 1)))  # the last layer rides along, dropped
    full = target(ids, target.new_cache(2, 12)).logits.log_softmax(-1)  # [B, N, V]: position p − 1 predicts p
    for b, p in response.nonzero().tolist():
        top = full[b, p - 1].topk(5)
        assert got.soft.ids[b, p].tolist() == top.indices.tolist()
        torch.testing.assert_close(got.soft.logp[b, p], top.values, atol=1e-4, rtol=1e-4)
    assert torch.isinf(got.soft.logp[~response]).all() and (got.soft.ids[~response] == 0).all()


def test_disk_cache_round_trips_the_top_k_beside_the_features(tmp_path):
    target = tiny_target("tiny-llama")
    rows = [
        {"seq_id": f"s{i}", "input_ids": torch.randint(0, 256, (6 + i,)).tolist(), "response_start": 2 + i % 2} for i in range(4)
    ]
    seqs = read_sequences(_write(tmp_path / "d.jsonl", rows), max_seq_len=32)
    FeatureSource(target, (0, 1), tmp_path / "cache")(seqs[:2])  # a cache built without soft labels
    source = FeatureSource(target, (0, 1), tmp_path / "cache", soft_k=4)
    built = source.batch(seqs)  # every sequence misses: two lack their top-k file
    read = source.batch(seqs)
    assert (source.misses, source.hits) == (4, 4)
    assert len(list((tmp_path / "cache").rglob("*.top4.pt"))) == 4 and len(list((tmp_path / "cache").rglob("*.tmp"))) == 0
    online = FeatureSource(target, (0, 1), soft_k=4).batch(seqs)
    for b, s in enumerate(seqs):
        resp = slice(s.response_start, len(s.input_ids))
        assert torch.equal(read.soft.ids[b], built.soft.ids[b]) and torch.equal(read.soft.logp[b], built.soft.logp[b])
        assert read.soft.ids[b, resp].tolist() == online.soft.ids[b, resp].tolist()
        torch.testing.assert_close(read.soft.logp[b, resp], online.soft.logp[b, resp], atol=0.05, rtol=0.02)  # bf16
        assert (
            torch.isinf(read.soft.logp[b, : s.response_start]).all() and torch.isinf(read.soft.logp[b, len(s.input_ids) :]).all()
        )
        n = len(s.input_ids)  # padding rows: zeros from the cache, the pad tokens' features online
        torch.testing.assert_close(read.features[b, :n], online.features[b, :n], atol=0.05, rtol=0.02)
