"""Cost-aware verification length: the expectation it maximises, its choices, and losslessness at
every length (0 = an AR round)."""

from __future__ import annotations

import itertools

import pytest
import torch

from drelay_model.decoding import GenerationConfig, SpeculativeEngine
from drelay_model.decoding.cost_policy import CostPolicy, PolicySettings, RoundCosts, expected_committed
from drelay_model.errors import DRelayError
from drelay_model.selectors import default_registry

H = 4


def set_counts(policy: CostPolicy, seen: list[float], hits: list[float], arm: int = 0) -> None:
    """Give an arm these recent and long-run counts (and as many first drafts verified in all)."""
    rates = policy.arms[arm]
    rates.seen, rates.hits, rates.base_seen, rates.base_hits = list(seen), list(hits), list(seen), list(hits)
    rates.first_verified = int(seen[0])


def one_row(*, verify_ms, block_ms: float, head_ms: float, select_ms: float, **more) -> RoundCosts:
    """A one-point (b = 1) surface whose drafting of h slots costs block_ms + h·head_ms."""
    slots = tuple(block_ms + h * head_ms for h in range(1, len(verify_ms)))
    return RoundCosts(verify_ms=tuple(verify_ms), draft_slots_ms=slots, select_ms=select_ms, **more)


def costs(verify=(30.0, 32.0, 34.0, 36.0, 38.0), block=5.0, head=1.0, select=1.0) -> RoundCosts:
    return one_row(verify_ms=verify, block_ms=block, head_ms=head, select_ms=select)


def test_expected_committed_is_the_mean_of_1_plus_accepted():
    p = [0.9, 0.5, 0.7, 0.2]
    e = expected_committed(p)
    for L in range(H + 1):  # brute force over accept/reject outcomes of the L verified drafts
        mean = 0.0
        for outcome in itertools.product([0, 1], repeat=L):
            prob = 1.0
            for i, o in enumerate(outcome):
                prob *= float(p[i]) if o else 1 - float(p[i])
            accepted = next((i for i, o in enumerate(outcome) if not o), L)
            mean += prob * (1 + accepted)
        assert float(e[L]) == pytest.approx(mean)


def test_choices_follow_the_costs():
    policy = CostPolicy(costs(), H)
    sure = torch.ones(2, H)
    assert policy.choose(sure * 0.999, H).tolist() == [H, H]  # cheap verification, sure drafts: all of them
    assert policy.choose(torch.full((2, H), 0.01), H).tolist() == [0, 0]  # hopeless drafts: verify none
    expensive = CostPolicy(costs(verify=(10.0, 100.0, 200.0, 300.0, 400.0)), H)
    assert expensive.choose(sure * 0.6, H).tolist() == [0, 0]
    # plan: with low running acceptance an AR round wins, but every `probe` rounds it drafts anyway
    slow = CostPolicy(costs(block=200.0), H, PolicySettings(probe=3))
    set_counts(slow, [100.0] * H, [5.0] * H)
    plans = [slow.plan() for _ in range(9)]
    assert plans.count(0) == 7 and plans[2] > 0  # probes at rounds 3 and 3 + 6 (the interval doubles)
    fast = CostPolicy(costs(block=1.0), H)
    set_counts(fast, [100.0] * H, [95.0] * H)
    assert fast.plan() == H


def test_observe_learns_acceptance_and_calibration():
    policy = CostPolicy(costs(), H, PolicySettings(prior=1.0))
    q = torch.full((4, H), 0.95)
    for _ in range(30):  # confident drafts that are always rejected at the first slot
        policy.observe(q, torch.full((4,), H), torch.zeros(4, dtype=torch.long))
    assert policy.slot_rates()[0] < 0.1
    assert policy.confidence(0.95) < 0.05  # the 0.9 bin learned it
    assert policy.confidence(0.15) == pytest.approx(0.15)  # an unseen bin keeps q


def test_bad_costs_are_clear_errors(tmp_path):
    with pytest.raises(DRelayError, match="verify_ms"):
        RoundCosts(verify_ms=(10.0, -1.0), draft_slots_ms=(1.0,), select_ms=1.0)
    with pytest.raises(DRelayError, match="draft_slots_ms"):
        RoundCosts(verify_ms=(10.0, 11.0), draft_slots_ms=(float("nan"),), select_ms=1.0)
    bad = tmp_path / "costs.json"
    bad.write_text("{not json")
    with pytest.raises(DRelayError, match="cannot read"):
        RoundCosts.load(bad)
    with pytest.raises(DRelayError, match="re-measure"):
        CostPolicy(costs(), num_slots=H + 3)
    good = costs()
    good.save(tmp_path / "c.json")
    assert RoundCosts.load(tmp_path / "c.json") == good


class _Forced(CostPolicy):
    """Verifies exactly `length` path tokens every round (0: an AR round), for the lossless test."""

    def __init__(self, length: int, num_slots: int, arm: int = 0):
        super().__init__(costs(verify=[1.0] * (num_slots + 1)), num_slots, native_arm=arm == 1)
        self.length, self.forced_arm = length, arm

    def plan(self, *, partial: bool = True, batch: int = 1) -> int:
        self.arm = self.forced_arm
        return self.length

    def choose(self, q, head_slots):
        return torch.full((q.shape[0],), min(self.length, head_slots), dtype=torch.long)


@pytest.mark.parametrize("name", default_registry().names())
def test_every_verification_length_is_lossless(target, make_drafter, prompts_of, tiny_selector_config, name):
    prompts = prompts_of(target.vocab_size, (5, 11, 3))
    drafter = make_drafter(target, top_k=16)
    torch.manual_seed(0)
    selector = default_registry().create(name, drafter=drafter, config=tiny_selector_config(name)).eval()
    cfg = GenerationConfig(max_new_tokens=24)
    greedy = SpeculativeEngine(target).generate(prompts, cfg).tokens
    H = drafter.config.num_slots
    arms = (0,) if selector.capabilities.native_path else (0, 1)  # 1: rounds that keep the native path
    for L, arm in itertools.product(sorted({0, 1, 2, H // 2, H}), arms):
        engine = SpeculativeEngine(target, drafter, selector, costs=costs(verify=[1.0] * (H + 1)))
        engine.policy = _Forced(L, H, arm)
        out = engine.generate(prompts, cfg)
        assert out.tokens == greedy, (L, arm)
        if L == 0:
            assert out.stats.tau == 1.0


@pytest.mark.parametrize("block_ms", [0.1, 1000.0])
def test_cost_aware_engine_is_lossless_and_falls_back_to_ar(target, make_drafter, prompts_of, block_ms):
    prompts = prompts_of(target.vocab_size, (6, 9))
    drafter = make_drafter(target, top_k=16)
    cfg = GenerationConfig(max_new_tokens=30)
    greedy = SpeculativeEngine(target).generate(prompts, cfg).tokens
    H = drafter.config.num_slots
    c = costs(verify=tuple(10.0 + i for i in range(H + 1)), block=block_ms, head=0.1, select=0.1)
    out = SpeculativeEngine(target, drafter, costs=c).generate(prompts, cfg)
    assert out.tokens == greedy
    if block_ms > 100:  # drafting never pays: all but the probe rounds are AR rounds
        assert out.stats.accept_hist[0] >= out.stats.rounds - 8


def test_rounds_extend_the_drafter_context_lazily_and_exactly(target, make_drafter):
    """Every round leaves its verified target features pending (an AR round all of them, a drafted
    round the first accepted + 1 of each row); the next drafted round extends the drafter's context
    and the verified history by all of them in one call. Both then equal extending them once per
    round, and dropping a row drops its pending features."""
    from drelay_model.decoding.batch_state import BatchState
    from drelay_model.decoding.history import VerifiedHistory

    drafter = make_drafter(target)
    F = len(drafter.config.target_layer_ids) * target.hidden_size
    g = torch.Generator().manual_seed(0)
    prefill = torch.randn(3, 5, F, generator=g)
    rounds = [(torch.randn(3, 1, F, generator=g), None), (torch.randn(3, 4, F, generator=g), torch.tensor([2, 4, 1])),
              (torch.randn(3, 1, F, generator=g), None), (torch.randn(3, 3, F, generator=g), torch.tensor([3, 1, 2])),
              (torch.randn(3, 1, F, generator=g), None)]  # fmt: skip
    eager, lazy = drafter.new_context_cache(3, 24), drafter.new_context_cache(3, 24)
    hist_eager, hist_lazy = VerifiedHistory(3, 3, F), VerifiedHistory(3, 3, F)  # shorter than the pending run
    with torch.no_grad():
        for ctx in (eager, lazy):
            drafter.extend_context(prefill, ctx)
        for h in (hist_eager, hist_lazy):
            h.push(prefill, torch.tensor([5, 2, 4]))
        for f, counts in rounds:  # one extension per round, cropped to what the round verified
            counts = torch.ones(3, dtype=torch.long) if counts is None else counts
            start = eager.lengths.clone()
            drafter.extend_context(f, eager)
            eager.crop(start + counts)
            hist_eager.push(f, counts)
        cache = target.new_cache(3, 24)
        state = BatchState(rows=[0, 1, 2], cache=cache, ctx=lazy, history=hist_lazy, anchor=torch.zeros(3, dtype=torch.long))
        for f, counts in rounds:
            state.defer(f, counts)
        state.keep([0, 2])  # row 1 finished: its pending features go with it
        eager.select_rows(torch.tensor([0, 2]))
        hist_eager.select_rows(torch.tensor([0, 2]))
        state.sync_context(drafter)
    assert state.pending == [] and torch.equal(lazy.lengths, eager.lengths) and lazy.lengths.tolist() == [5 + 8, 5 + 6]
    assert torch.equal(hist_lazy.feats, hist_eager.feats) and torch.equal(hist_lazy.count, hist_eager.count)
    assert torch.equal(hist_lazy.mask(), hist_eager.mask())
    n = int(eager.lengths.max())
    torch.testing.assert_close(lazy.k[..., :n, :], eager.k[..., :n, :], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lazy.v[..., :n, :], eager.v[..., :n, :], atol=1e-5, rtol=1e-5)


def test_isotonic_fit_is_non_decreasing_and_pools_outliers():
    from drelay_model.decoding.cost_policy import isotonic

    assert isotonic([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]
    assert isotonic([3.0, 1.0, 2.0]) == pytest.approx([2.0, 2.0, 2.0])
    assert isotonic([1.0, 3.0, 2.0, 4.0]) == pytest.approx([1.0, 2.5, 2.5, 4.0])
    # one slow first call moves only the pooled block, not the whole curve (a running max would
    # have made every width cost 30)
    fit = isotonic([30.0, 20.0, 21.0, 22.0, 35.0, 36.0])
    assert fit == sorted(fit) and fit[-1] == 36.0 and fit[0] < 30.0


def test_measured_times_rescale_the_curve_and_move_the_plan():
    """Drafting measured far slower than modelled (caches the target flushed, a busy machine) turns
    the plan to AR rounds; measured in line with the model, the scales stay at 1. One spike moves a
    scale by at most 2× (log-ratio clipped), and `time_decay` is range-checked."""
    base = costs(verify=(30.0, 30.5, 31.0, 31.5, 32.0), block=1.0, head=0.1, select=0.1)
    steady = CostPolicy(base, H)
    set_counts(steady, [100.0] * H, [30.0] * H)
    for _ in range(20):
        steady.observe_times(verify_width=3, verify_ms=31.0, head_slots=H, decided=H, draft_ms=base.draft_ms(H))
    assert steady.draft_ms(H) == pytest.approx(base.draft_ms(H)) and steady.verify_ms(3) == pytest.approx(31.0)
    assert steady.plan() > 0  # cheap drafting: worth it at â = 0.3

    slow = CostPolicy(base, H)
    set_counts(slow, [100.0] * H, [30.0] * H)
    slow.observe_times(verify_width=1, verify_ms=30.0, head_slots=H, decided=H, draft_ms=1e6)  # one spike
    assert slow.draft_ms(H) <= base.draft_ms(H) * 2 ** (1 - slow.settings.time_decay) + 1e-9
    for _ in range(60):  # drafting really takes 12× the model
        slow.observe_times(verify_width=1, verify_ms=30.0, head_slots=H, decided=H, draft_ms=12 * base.draft_ms(H))
    assert slow.draft_ms(H) == pytest.approx(12 * base.draft_ms(H), rel=0.05)
    assert slow.plan() == 0
    with pytest.raises(DRelayError, match="time_decay"):
        CostPolicy(base, H, PolicySettings(time_decay=1.0))
    for bad in ({"probe": 0}, {"probe": 8, "max_probe": 4}):  # the probe interval halves and doubles
        with pytest.raises(DRelayError, match="probe and max_probe"):
            CostPolicy(base, H, PolicySettings(**bad))


def test_rarely_reached_slots_borrow_the_rate_below_and_wide_verifies_learn_their_own_scale():
    """On low-acceptance text slot 2+ is seldom verified; its rate follows slot 1's instead of an
    optimistic constant, so the plan turns to AR rounds. One-token and wider verifies keep separate
    running scales (the curve's slope, not only its level)."""
    # E(L) / t(L) with â = (0.2, ½, ½, ½) would draft 4 slots: 1.375 / 40.4 ms > 1 / 30 ms
    c = costs(verify=(30.0, 30.5, 31.0, 31.5, 32.0), block=8.0, head=0.1, select=0.1)
    policy = CostPolicy(c, H)
    q = torch.full((1, H), 0.5)
    for _ in range(40):  # slot 1 accepted in 1 round of 5, never further
        for acc in (1, 0, 0, 0, 0):
            policy.observe(q, torch.tensor([H]), torch.tensor([acc]))
    rates = policy.slot_rates()
    assert rates[0] == pytest.approx(0.2, abs=0.03) and all(r < 0.2 for r in rates[1:])
    assert policy.plan() == 0  # E(L) ≤ 1.25 does not pay for drafting + the wider verify
    for _ in range(40):
        policy.observe_times(verify_width=1, verify_ms=30.0)
        policy.observe_times(verify_width=5, verify_ms=48.0, head_slots=H, decided=H, draft_ms=c.draft_ms(H))
    assert policy.verify_ms(1) == pytest.approx(30.0) and policy.verify_ms(5) == pytest.approx(48.0, rel=0.02)
    with pytest.raises(DRelayError, match="rate_prior"):
        CostPolicy(c, H, PolicySettings(rate_prior=0.0))


def test_the_policy_carries_what_it_learned_across_generate_calls(target, make_drafter, prompts_of):
    prompts = prompts_of(target.vocab_size, (6,))
    drafter = make_drafter(target, top_k=16)
    H = drafter.config.num_slots
    c = one_row(verify_ms=tuple(10.0 + 0.1 * i for i in range(H + 1)), block_ms=0.1, head_ms=0.01, select_ms=0.01)
    engine = SpeculativeEngine(target, drafter, costs=c)
    policy = engine.policy
    first = engine.generate(prompts, GenerationConfig(max_new_tokens=12))
    seen = sum(policy.arms[0].seen)
    assert seen > 0 and engine.policy is policy
    second = engine.generate(prompts, GenerationConfig(max_new_tokens=12))
    assert second.tokens == first.tokens and sum(policy.arms[0].seen) != seen  # same output, state went on


def test_evidence_fades_towards_the_long_run_rate_not_an_optimistic_prior():
    """During AR rounds an arm's recent counts fade (`idle_decay`) towards its long-run rate: text
    that kept rejecting stays on AR rounds between probes (fading towards ½ made every faded estimate
    look worth a losing drafted round), while a short bad stretch of text that usually accepts
    gives way to drafting again before any probe."""
    c = costs(verify=(30.0, 30.5, 31.0, 31.5, 32.0), block=8.0, head=0.1, select=0.1)  # break-even ≈ 0.29
    policy = CostPolicy(c, H, PolicySettings(max_probe=10_000, probe=10_000, idle_decay=0.9))
    q = torch.full((1, H), 0.5)
    for _ in range(60):  # κ = 16 pseudo-counts: it takes a few dozen rejecting rounds to be sure
        policy.observe(q, torch.tensor([H]), torch.tensor([0]))
    plans = [policy.plan() for _ in range(200)]
    assert plans == [0] * 200 and policy.slot_rates()[0] < 0.2
    usual = CostPolicy(c, H, PolicySettings(max_probe=10_000, probe=10_000, idle_decay=0.9))
    rates = usual.arms[0]
    rates.base_seen, rates.base_hits = [50.0] * H, [45.0] * H  # the long run: 90% accepted
    rates.seen, rates.hits = [60.0] * H, [0.0] * H  # the last few dozen rounds: nothing accepted
    rates.first_verified = 200  # a warm policy: no cold-start optimism left to speak of
    plans = [usual.plan() for _ in range(200)]
    assert plans[0] == 0 and any(p > 0 for p in plans)
    with pytest.raises(DRelayError, match="idle_decay"):
        CostPolicy(c, H, PolicySettings(idle_decay=1.0))
    with pytest.raises(DRelayError, match="base_decay"):
        CostPolicy(c, H, PolicySettings(base_decay=-0.1))


def test_a_probe_verifies_at_least_one_draft_and_a_hit_moves_the_estimate_at_once():
    c = costs(verify=(30.0, 30.5, 31.0, 31.5, 32.0), block=8.0, head=0.1, select=0.1)
    policy = CostPolicy(c, H, PolicySettings(probe=2))
    set_counts(policy, [40.0] * H, [4.0] * H)
    assert [policy.plan(), policy.plan()][0] == 0 and policy._probing  # the second plan is a probe
    hopeless = torch.full((1, 1), 0.01)
    assert policy.choose(hopeless, 1).tolist() == [1]  # a probe still verifies its draft
    before = policy.slot_rates()[0]
    for _ in range(300):  # fading during AR rounds: back to the long-run rate (~0.2), not ½
        policy.plan()
    faded = policy.slot_rates()[0]
    assert faded == pytest.approx(policy.arms[0].base_rates(policy.settings.base_prior)[0], abs=0.02) and before < faded < 0.3
    policy.observe(torch.full((1, 1), 0.5), torch.tensor([1]), torch.tensor([1]))
    assert policy.slot_rates()[0] > faded + 0.03  # one hit: about (1 − â) / (κ + 1)


def test_the_rest_of_a_drafted_round_counts_against_drafting():
    """Drafted rounds whose whole time exceeds their drafting + verify phases (acceptance, crops,
    the policy's own work) carry that rest o into the plan; with it drafting stops paying."""
    c = costs(verify=(30.0, 30.5, 31.0, 31.5, 32.0), block=1.0, head=0.1, select=0.1)
    policy = CostPolicy(c, H)
    set_counts(policy, [100.0] * H, [30.0] * H)
    assert policy.plan() > 0
    for _ in range(60):
        policy.observe_times(verify_width=1, verify_ms=30.0, round_ms=30.2)  # AR rounds: 0.2 ms of rest
        policy.observe_times(
            verify_width=5, verify_ms=32.0, head_slots=H, decided=H, draft_ms=c.draft_ms(H), round_ms=32.0 + c.draft_ms(H) + 12.0
        )
    assert policy.other_ms[0] == pytest.approx(0.2, rel=0.01) and policy.other_ms[1] == pytest.approx(12.0, rel=0.01)
    assert policy.round_ms(H, H, 5) == pytest.approx(c.draft_ms(H) + 32.0 + 12.0, rel=0.01)
    assert policy.plan() == 0


def test_an_untimed_verify_width_borrows_the_timed_ones_scale():
    """The surface prices every verify 1.5× too slow (the machine got faster since). While drafting
    wins no AR round is timed, so one-token verifies take the wider verifies' learned scale. Once AR
    rounds are timed, their own scale takes over from the borrowed one."""
    c = costs(verify=(45.0, 48.0, 51.0, 54.0, 57.0), block=1.0, head=0.1, select=0.1)
    policy = CostPolicy(c, H)
    set_counts(policy, [100.0] * H, [40.0] * H)  # per-slot acceptance 0.4: E(1) = 1.4
    assert policy.verify_ms(1) == pytest.approx(45.0)
    for _ in range(60):
        policy.observe_times(verify_width=2, verify_ms=32.0, head_slots=1, decided=1, draft_ms=c.draft_ms(1))
    assert policy.verify_ms(2) == pytest.approx(32.0, rel=0.02)
    assert policy.verify_ms(1) == pytest.approx(45.0 * 32.0 / 48.0, rel=0.02)  # borrowed
    for _ in range(60):
        policy.observe_times(verify_width=1, verify_ms=20.0)
    assert policy.verify_ms(1) == pytest.approx(20.0, rel=0.02)  # its own, from the borrowed start
    assert policy.verify_ms(2) == pytest.approx(32.0, rel=0.02)
