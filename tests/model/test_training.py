"""Training math: block labels, anchors, the scout against a sequential reference, support loss."""

from __future__ import annotations

import pytest
import torch

from drelay_model.decoding import GenerationConfig, SpeculativeEngine, replay
from drelay_model.training.step import DraftTrainModule, StepConfig, history_windows, training_step
from drelay_model.selectors import default_registry
from drelay_model.target import tiny_target
from drelay_model.training.anchors import eligible_anchors, make_blocks, sample_uniform_anchors, scout_anchors
from drelay_model.training.schedules import lr_at


def test_block_labels_stop_at_the_first_non_response_position():
    ids = torch.arange(10)[None]
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1, 1, 1]], dtype=torch.bool)
    blocks = make_blocks(ids, mask, torch.tensor([[2, 6, 8]]), torch.tensor([[True, True, True]]), H=4)
    assert blocks.valid[0].tolist() == [
        [True, True, False, False],  # 3, 4 are response; 5 is not, so 6.. are not contiguous
        [True, True, True, False],  # 7, 8, 9 then the sequence ends
        [True, False, False, False],
    ]
    assert blocks.labels[0, 0, :2].tolist() == [3, 4] and blocks.labels[0, 0, 2:].tolist() == [0, 0]
    assert eligible_anchors(mask)[0].tolist() == [False, False, True, True, False, False, True, True, True, False]


def test_uniform_anchors_are_distinct_and_eligible():
    eligible = torch.zeros(2, 50, dtype=torch.bool)
    eligible[0, 10:40] = True
    eligible[1, 45:48] = True
    anchors, ok = sample_uniform_anchors(eligible, 8, torch.Generator().manual_seed(0))
    assert ok[0].all() and len(set(anchors[0].tolist())) == 8 and all(10 <= a < 40 for a in anchors[0].tolist())
    assert ok[1].sum() == 3 and sorted(anchors[1][ok[1]].tolist()) == [45, 46, 47]


def _data(target, n=24, new=40):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, target.vocab_size, (6,), generator=g).tolist() for _ in range(n)]
    outs = SpeculativeEngine(target).generate(prompts, GenerationConfig(max_new_tokens=new)).tokens
    ids = torch.tensor([p + o for p, o in zip(prompts, outs)])
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 6:] = True
    return prompts, outs, ids, mask


def test_scout_traces_the_boundaries_of_native_greedy_decoding(target, make_drafter):
    """From the same start, the scout's boundaries are exactly the anchors replay visits."""
    drafter = make_drafter(target, top_k=8)
    prompts, outs, ids, mask = _data(target, n=3)
    feats = target(ids, target.new_cache(3, ids.shape[1]), feature_layers=drafter.config.target_layer_ids).features
    ctx = drafter.context_kv(feats, torch.arange(ids.shape[1])[None].expand(3, -1))
    start_mask = mask.clone()  # make the first response token the only possible start
    gen = torch.Generator().manual_seed(0)
    elig = eligible_anchors(mask)
    only_first = torch.zeros_like(elig)
    only_first[:, 6] = True
    import drelay_model.training.anchors as tr

    real = tr.sample_uniform_anchors
    tr.sample_uniform_anchors = lambda e, m, g: real(only_first, m, g)
    try:
        anchors, ok = scout_anchors(drafter, ctx, ids, ids, start_mask, 50, gen)
    finally:
        tr.sample_uniform_anchors = real
    for b in range(3):  # sequential reference: native rounds over the greedy continuation
        a, expect = 6, []
        while a < ids.shape[1] - 1:
            expect.append(a)
            hidden = drafter.block_hidden(
                ids[b : b + 1, a : a + 1], torch.tensor([[a]]), [(k[b : b + 1], v[b : b + 1]) for k, v in ctx]
            )
            native = drafter.logits(hidden[:, 0, 1:]).argmax(-1)[0]
            ref = ids[b, a + 1 : a + 1 + drafter.config.num_slots]
            n = int((native[: len(ref)] == ref).long().cumprod(0).sum())
            a += n + 1
        assert anchors[b][ok[b]].tolist() == expect


def test_lr_schedule_warms_up_then_decays():
    lrs = [lr_at(s, base=1.0, warmup=10, total=100) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[99] == pytest.approx(0.1, abs=0.01) and all(a >= b for a, b in zip(lrs[10:], lrs[11:]))


def _train(module, ids, mask, feats, steps, cfg, lr=3e-3):
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=lr)
    gen = torch.Generator().manual_seed(0)
    module.train()
    for _ in range(steps):
        i = torch.randint(0, ids.shape[0], (8,), generator=gen)
        out = training_step(module, module, ids[i], mask[i], feats[i], cfg, gen)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    return out


# 10 s per architecture here: the default suite trains the Llama-shaped target; the Qwen3-shaped one's
# training step is checked by every other test of this file, its 120-step run by `make test-heavy`.
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["tiny-llama", pytest.param("tiny-qwen3", marks=pytest.mark.heavy)])
def test_a_short_training_run_raises_replay_tau(arch, make_drafter):
    target = tiny_target(arch)
    drafter = make_drafter(target, num_layers=2)
    prompts, outs, ids, mask = _data(target, n=48)
    feats = target(ids, target.new_cache(48, ids.shape[1]), feature_layers=drafter.config.target_layer_ids).features
    before = replay(target, drafter.eval(), prompts[:6], outs[:6]).tau
    _train(DraftTrainModule(drafter), ids, mask, feats, 120, StepConfig(anchors_per_seq=16, native_fraction=0.3))
    after = replay(target, drafter.eval(), prompts[:6], outs[:6]).tau
    assert after > before + 0.2, (before, after)


def test_joint_step_trains_drafter_and_selector_and_stays_lossless(target, make_drafter):
    drafter = make_drafter(target, num_layers=1, top_k=8)
    selector = default_registry().create(
        "drelay", drafter=drafter, config={"d_sel": 32, "read_dim": 32, "compact_dim": 16, "history_len": 8}
    )
    module = DraftTrainModule(drafter, selector)
    prompts, outs, ids, mask = _data(target, n=16, new=24)
    feats = target(ids, target.new_cache(16, ids.shape[1]), feature_layers=drafter.config.target_layer_ids).features
    before = {k: v.clone() for k, v in module.state_dict().items()}
    out = _train(module, ids, mask, feats, 3, StepConfig(anchors_per_seq=6, native_fraction=0.5, alpha=1.0, beta=1.0))
    assert {"loss/support", "loss/selector", "pool/coverage", "selector/acc", "selector/repair_rate"} <= out.metrics.keys()
    changed = {k for k, v in module.state_dict().items() if not torch.equal(v, before[k])}
    assert any(k.startswith("drafter.layers") for k in changed) and any(k.startswith("selector.") for k in changed)
    assert "drafter.embed_weight" not in module.state_dict()  # frozen target weights are buffers, never trained
    from drelay_model.decoding import SpeculativeEngine as Engine

    spec = Engine(target, drafter.eval(), selector.eval()).generate(prompts[:3], GenerationConfig(max_new_tokens=24))
    assert spec.tokens == outs[:3]


def test_decision_metrics_count_fixes_and_breaks_by_the_keep_repair_rule():
    from drelay_model.training.step import decision_metrics

    cand = torch.tensor([[[5, 6, 7], [5, 6, 7], [5, 6, 7], [5, 6, 7]]])  # [R=1, H=4, K=3]
    labels = torch.tensor([[6, 5, 7, 5]])
    valid = torch.tensor([[True, True, True, False]])
    rank = torch.tensor(
        [[[0.0, 2.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 0.0], [0.0, 2.0, 0.0]]]
    )  # k* = 1 (r = 0.88), or a tie (r = 0.5)
    gate = torch.tensor([[1.0, 1.0, -5.0, 1.0]])  # slots 1, 2, 4 repair to 6; slot 3 keeps (g + log r < 0)
    m = decision_metrics(gate, rank, cand, labels, valid)
    # slot 1: native 5 wrong, repair 6 right (fixed); slot 2: native 5 right, repair 6 wrong (broke);
    # slot 3: keep 5, label 7 — both wrong; slot 4 is invalid.
    assert m == {"selector/acc": pytest.approx(1 / 3), "selector/native_acc": pytest.approx(1 / 3),
                 "selector/repair_rate": pytest.approx(2 / 3), "selector/fixed": pytest.approx(1 / 3),
                 "selector/broke": pytest.approx(1 / 3)}  # fmt: skip
    fresh = decision_metrics(torch.full((1, 4), -1.0), torch.zeros(1, 4, 3), cand, labels, valid)
    assert fresh["selector/repair_rate"] == 0 and fresh["selector/acc"] == fresh["selector/native_acc"]


def test_history_windows_match_the_engine_layout():
    feats = torch.arange(2 * 10 * 1, dtype=torch.float32).view(2, 10, 1)
    win, mask = history_windows(feats, torch.tensor([[3, 9], [0, 5]]), 4)
    assert win[0, :, 0].tolist() == [0, 0, 1, 2] and mask[0].tolist() == [False, True, True, True]
    assert win[1, :, 0].tolist() == [5, 6, 7, 8] and mask[1].all()
    assert mask[2].tolist() == [False] * 4 and win[3, :, 0].tolist() == [11, 12, 13, 14]


def test_scout_restarts_chains_so_every_row_yields_its_share(target, make_drafter):
    """A chain that runs off the response restarts at a fresh uniform position: m eligible anchors
    per row (one chain alone runs out on short responses)."""
    drafter = make_drafter(target, top_k=8)
    prompts, outs, ids, mask = _data(target, n=3, new=12)
    feats = target(ids, target.new_cache(3, ids.shape[1]), feature_layers=drafter.config.target_layer_ids).features
    ctx = drafter.context_kv(feats, torch.arange(ids.shape[1])[None].expand(3, -1))
    m = 12
    single, single_ok = scout_anchors(drafter, ctx, ids, ids, mask, m, torch.Generator().manual_seed(0))
    chains, chains_ok = scout_anchors(drafter, ctx, ids, ids, mask, m, torch.Generator().manual_seed(0), restart=True)
    elig = eligible_anchors(mask)
    assert bool(chains_ok.all()) and bool(torch.gather(elig, 1, chains).all())
    assert int(single_ok.sum()) < int(chains_ok.sum()) == 3 * m
    # The first chain is the same either way (same start, same native path).
    for b in range(3):
        n = int(single_ok[b].sum())
        assert chains[b, :n].tolist() == single[b, :n].tolist()


def test_scout_with_an_oracle_policy_advances_a_whole_block(target, make_drafter):
    drafter = make_drafter(target, top_k=8)
    prompts, outs, ids, mask = _data(target, n=2, new=40)
    feats = target(ids, target.new_cache(2, ids.shape[1]), feature_layers=drafter.config.target_layer_ids).features
    ctx = drafter.context_kv(feats, torch.arange(ids.shape[1])[None].expand(2, -1))
    oracle = lambda block, anchor_ids, anchor_pos, labels: labels  # noqa: E731
    anchors, ok = scout_anchors(drafter, ctx, ids, ids, mask, 3, torch.Generator().manual_seed(1), policy=oracle)
    H = drafter.config.num_slots
    for b in range(2):
        a = anchors[b][ok[b]].tolist()
        assert all(y - x == H + 1 for x, y in zip(a, a[1:]))  # every draft accepted: a += H + 1


def test_joint_step_realises_the_native_anchor_fraction(target, make_drafter):
    drafter = make_drafter(target, num_layers=1, top_k=8)
    selector = default_registry().create(
        "drelay", drafter=drafter, config={"d_sel": 32, "read_dim": 32, "compact_dim": 16, "history_len": 8}
    )
    module = DraftTrainModule(drafter, selector)
    prompts, outs, ids, mask = _data(target, n=4, new=10)
    feats = target(ids, target.new_cache(4, ids.shape[1]), feature_layers=drafter.config.target_layer_ids).features
    for policy in ("native", "selector"):
        cfg = StepConfig(anchors_per_seq=8, native_fraction=0.5, scout_policy=policy, scout_restart=True)
        out = training_step(module, module, ids, mask, feats, cfg, torch.Generator().manual_seed(0))
        assert out.metrics["anchors/native_fraction"] == pytest.approx(0.5)
        assert torch.isfinite(out.loss)
