"""The cost-aware policy's two arms (drafted rounds that run the selector, or keep the native path
without it), and DRelay on the short blocks that cost-aware rounds draft."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from drelay_model.decoding import GenerationConfig, SpeculativeEngine
from drelay_model.decoding.cost_policy import CostPolicy, PolicySettings, RoundCosts
from drelay_model.errors import DRelayError
from drelay_model.selectors import SelectionContext, default_registry
from tests.model.test_verify_length import one_row, set_counts

H = 4


def costs(select: float = 1.0) -> RoundCosts:
    return one_row(verify_ms=(30.0, 30.5, 31.0, 31.5, 32.0), block_ms=1.0, head_ms=0.1, select_ms=select)


def test_the_native_path_costs_no_selection():
    c = costs(select=5.0)
    assert c.draft_ms(2, decided=0) == pytest.approx(c.draft_ms(2, decided=2) - 5.0 - c.select_slot_ms[0])


def test_the_plan_runs_the_selector_only_where_its_repairs_pay():
    equal = CostPolicy(costs(select=8.0), H, native_arm=True)
    set_counts(equal, [100.0] * H, [80.0] * H, 0)
    set_counts(equal, [100.0] * H, [80.0] * H, 1)
    assert equal.plan() > 0 and not equal.use_selector  # the same acceptance, cheaper without it
    better = CostPolicy(costs(select=0.5), H, native_arm=True)
    set_counts(better, [100.0] * H, [90.0] * H, 0)
    set_counts(better, [100.0] * H, [40.0] * H, 1)
    assert better.plan() > 0 and better.use_selector  # its repairs accept more than they cost
    single = CostPolicy(costs(), H)
    assert len(single.arms) == 1 and single.use_selector


def test_the_selector_arm_starts_from_the_native_arms_rates():
    """An arm with no evidence of its own read ½ per slot (and ran in a third of the demo's drafted
    rounds); the selector keeps the native path unless it repairs it, so it starts from that path's."""
    policy = CostPolicy(costs(select=0.5), H, native_arm=True)
    set_counts(policy, [100.0] * H, [10.0] * H, 1)
    assert (
        policy.slot_rates(0) == pytest.approx(policy.arms[1].base_rates(policy.settings.base_prior))
        and policy.slot_rates(0)[0] < 0.12
    )
    priced = CostPolicy(
        one_row(verify_ms=(30.0, 30.5, 31.0, 31.5, 32.0), block_ms=8.0, head_ms=0.1, select_ms=0.5), H, native_arm=True
    )
    set_counts(priced, [100.0] * H, [10.0] * H, 1)
    set_counts(priced, [30.0] * H, [3.0] * H, 0)
    assert priced.plan() == 0  # break-even ≈ 29%: 10% does not pay on either arm once both have shown it


def test_observations_go_to_the_arm_that_ran_and_probes_take_the_best_upper_estimate():
    policy = CostPolicy(costs(select=0.5), H, PolicySettings(probe=1), native_arm=True)
    set_counts(policy, [200.0] * H, [2.0] * H, 1)  # the native arm: well known and hopeless
    set_counts(policy, [2.0] * H, [0.0] * H, 0)  # the selector's: two misses, little evidence
    assert policy.plan() > 0 and policy._probing and policy.arm == 0  # AR wins; the probe goes where â⁺ is highest
    assert policy.upper_rates(0)[0] > policy.upper_rates(1)[0] + 0.03
    before = list(policy.arms[1].seen)
    policy.observe(torch.full((1, 1), 0.5), torch.tensor([1]), torch.tensor([1]))
    assert policy.arms[1].seen == before and policy.arms[0].hits[0] > 1.0 * policy.settings.rate_decay


def test_engines_get_the_arms_their_selector_allows(target, make_drafter):
    drafter = make_drafter(target, top_k=16)
    c = one_row(verify_ms=tuple(10.0 + i for i in range(drafter.config.num_slots + 1)), block_ms=1.0, head_ms=0.1, select_ms=0.1)
    drelay = default_registry().create("drelay", drafter=drafter).eval()
    assert len(SpeculativeEngine(target, drafter, drelay, costs=c).policy.arms) == 2
    assert len(SpeculativeEngine(target, drafter, costs=c).policy.arms) == 1  # native: nothing cheaper to keep


def test_native_arm_rounds_never_call_the_selector_and_stay_lossless(target, make_drafter, prompts_of, tiny_selector_config):
    drafter = make_drafter(target, top_k=16)
    selector = default_registry().create("drelay", drafter=drafter, config=tiny_selector_config("drelay")).eval()
    calls = []
    real_select = selector.select
    selector.select = lambda block, ctx: calls.append(block.cand_ids.shape[1]) or real_select(block, ctx)
    Hd = drafter.config.num_slots
    c = one_row(verify_ms=tuple(10.0 + 0.01 * i for i in range(Hd + 1)), block_ms=0.1, head_ms=0.01, select_ms=1000.0)
    prompts = prompts_of(target.vocab_size, (6, 9))
    cfg = GenerationConfig(max_new_tokens=20)
    greedy = SpeculativeEngine(target).generate(prompts, cfg).tokens
    engine = SpeculativeEngine(target, drafter, selector, costs=c)
    policy = engine.policy
    for a in (0, 1):
        policy.arms[a].seen, policy.arms[a].hits = [100.0] * Hd, [99.0] * Hd
    out = engine.generate(prompts, cfg)
    assert out.tokens == greedy
    assert calls == [] and out.stats.steps < sum(len(t) for t in out.tokens)  # drafted, never selected
    assert out.stats.drafted_steps > 0 and out.stats.selector_steps == 0
    free = dataclasses.replace(c, select_ms=0.0)  # now selecting is free and its arm the one trusted
    engine = SpeculativeEngine(target, drafter, selector, costs=free)
    for a in (0, 1):
        engine.policy.arms[a].seen, engine.policy.arms[a].hits = [100.0] * Hd, [99.0 - 90 * a] * Hd
    out = engine.generate(prompts, cfg)
    assert out.tokens == greedy and 0 < out.stats.selector_steps <= out.stats.drafted_steps <= out.stats.steps
    assert len(calls) == out.stats.selector_steps


def test_drelay_selects_on_a_short_block(target, make_drafter, prompts_of, tiny_selector_config):
    """Cost-aware rounds draft only the slots they may verify; DRelay's Global Read then reads that
    shorter block (its slot parameters sliced to it). A longer or mis-shaped block is an error."""
    drafter = make_drafter(target, top_k=16)
    selector = default_registry().create("drelay", drafter=drafter, config=tiny_selector_config("drelay")).eval()
    ids = torch.tensor(prompts_of(target.vocab_size, (9,)))
    cache = target.new_cache(1, 40)
    res = target(ids, cache, feature_layers=drafter.config.target_layer_ids)
    ctx = drafter.new_context_cache(1, 40)
    drafter.extend_context(res.features, ctx)
    sctx = SelectionContext(anchor_ids=ids[:, -1], anchor_pos=ctx.lengths.clone(), row_ids=torch.zeros(1, dtype=torch.long))
    for h in (1, 2, drafter.config.num_slots):
        block = drafter.draft(ids[:, -1], ctx, slots=h)
        sel = selector.select(block, sctx)
        assert sel.pool_index.shape == (1, h) and sel.length.tolist() == [h]
        assert torch.equal(sel.path_ids, block.cand_ids.gather(2, sel.pool_index[..., None])[..., 0])
    gr = selector.global_read
    full = gr.rel_bias.shape[1] // 2 + 1
    for h in (1, 3):  # the offset j − i reads the same learned bias in a short block
        short = gr.rel_bias_for(h)
        assert short.shape == (gr.rel_bias.shape[0], 2 * h - 1)
        assert torch.equal(short[:, h - 1], gr.rel_bias[:, full - 1])
    too_long = drafter.draft(ids[:, -1], ctx)
    bad = type(too_long)(hidden=too_long.hidden, cand_ids=too_long.cand_ids[:, :, :4], cand_logq=too_long.cand_logq[:, :, :4])
    with pytest.raises(DRelayError, match="built for"):
        selector.select(bad, sctx)


class _ArThenDraft(CostPolicy):
    """AR rounds for `ar_rounds` rounds, then one-draft rounds; records what `observe_times` is told."""

    def __init__(self, c: RoundCosts, num_slots: int, ar_rounds: int):
        super().__init__(c, num_slots)
        self.ar_rounds, self.rounds, self.told = ar_rounds, 0, []

    def plan(self, *, partial: bool = True, batch: int = 1) -> int:
        self.rounds += 1
        self.arm = 0
        return 0 if self.rounds <= self.ar_rounds else 1

    def observe_times(self, **kw) -> None:
        self.told.append(kw)
        super().observe_times(**kw)


def test_the_catch_up_after_ar_rounds_is_not_charged_to_drafting(target, make_drafter, prompts_of):
    """The first drafted round after a stretch of AR rounds extends the drafter's context by all of
    their positions. That catch-up is paid whenever drafting resumes, so the policy is told the
    round's drafting and whole time with the curve's one-round extension in its place; the stats
    still count all of it as drafting. (The extension is slowed here by a sleep on catch-ups only.)"""
    import time as _time

    drafter = make_drafter(target, top_k=16)
    n = drafter.config.num_slots
    c = one_row(verify_ms=tuple(30.0 + 0.5 * i for i in range(n + 1)), block_ms=1.0, head_ms=0.1, select_ms=1.0, extend_ms=0.5)
    engine = SpeculativeEngine(target, drafter, costs=c)
    engine.policy = policy = _ArThenDraft(c, drafter.config.num_slots, ar_rounds=6)
    real = drafter.extend_context

    def slow_on_catch_up(feats, ctx):
        if feats.shape[1] >= 6:  # the six AR rounds' positions, not a prefill (it runs before any round)
            _time.sleep(0.2)
        return real(feats, ctx)

    drafter.extend_context = slow_on_catch_up
    try:
        out = engine.generate(prompts_of(target.vocab_size, (5,)), GenerationConfig(max_new_tokens=10))
    finally:
        drafter.extend_context = real
    assert out.stats.drafted_steps >= 1 and out.stats.time_draft >= 0.2  # the stats keep it
    drafted = [kw for kw in policy.told if kw.get("head_slots", 0) > 0]
    assert drafted[0]["draft_ms"] < 150 and drafted[0]["round_ms"] < 150 + drafted[0]["verify_ms"]
