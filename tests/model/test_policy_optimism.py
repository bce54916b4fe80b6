"""The cost-aware plan's optimism (`PolicySettings.optimism`, `SlotRates.upper_rates`): drafting is
priced at â⁺ = â + z standard errors of a first-slot rate seen N times, so a cold policy is not
talked out of drafting by a few early misses, and a policy that has seen enough still stops."""

from __future__ import annotations

import pytest
import torch

from benchmarks.bench_policy import simulate
from drelay_model.decoding.cost_policy import CostPolicy, PolicySettings
from drelay_model.errors import DRelayError
from tests.model.test_verify_length import costs

H = 4
BREAK_EVEN_COSTS = dict(verify=(30.0, 30.5, 31.0, 31.5, 32.0), block=8.0, head=0.1, select=0.1)  # first draft ≈ 29%


def cold(optimism: float | None = None) -> CostPolicy:
    z = {} if optimism is None else {"optimism": optimism}  # None: the default
    return CostPolicy(costs(**BREAK_EVEN_COSTS), H, PolicySettings(probe=10_000, max_probe=10_000, **z))


def miss(policy: CostPolicy, rounds: int) -> None:
    for _ in range(rounds):
        policy.observe(torch.full((1, H), 0.5), torch.tensor([H]), torch.tensor([0]))


def test_three_early_misses_do_not_stop_drafting_thirty_do():
    for z, plans_after_3 in ((0.0, False), (None, True)):
        policy = cold(z)
        miss(policy, 3)
        assert (policy.plan() > 0) == plans_after_3, z
    policy = cold()
    miss(policy, 30)
    assert policy.plan() == 0 and policy.upper_rates()[0] < 0.15


def test_optimism_raises_only_the_first_slot_and_vanishes_with_evidence():
    """Deeper slots are verified only after hits below them: a bonus there would hardly shrink and
    would keep buying LM heads that are not verified. N is not decayed (the long-run counts are):
    the bonus is for a cold start, not a lasting bias towards drafting on break-even text."""
    policy = cold(1.0)
    miss(policy, 4)
    few = [u - a for u, a in zip(policy.upper_rates(), policy.slot_rates())]
    assert policy.arms[0].first_verified == 4 and few[0] > 0.05 and few[1:] == [0.0] * (H - 1)
    for _ in range(996):
        policy.observe(torch.full((1, H), 0.5), torch.tensor([H]), torch.tensor([1]))
    a = policy.slot_rates()[0]
    assert sum(policy.arms[0].base_seen) < 200  # the long-run counts hold ~50 rounds per slot
    assert policy.upper_rates()[0] - a == pytest.approx((a * (1 - a) / 1001) ** 0.5, rel=1e-6)


def test_a_text_that_opens_badly_and_then_accepts_is_drafted():
    """The demo prompt's shape: 2 first drafts accepted in the first 16 rounds, then 40%. Without
    optimism the plan stays on AR rounds (probes double their interval while they lose)."""
    hits = [0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0] + [1, 0, 1, 0, 0] * 40
    rounds = [[(bool(h), 0.5) for h in hits]]  # (hit, q) per one-draft round, as bench_policy records them
    speedup = {z: simulate(rounds, costs(**BREAK_EVEN_COSTS), (16.0, 2.0, 0.0, z)) for z in (0.0, 1.0)}  # the defaults but z
    assert speedup[1.0] > 1.05 and speedup[1.0] > 1.05 * speedup[0.0]


def test_optimism_has_a_range():
    for bad in (-0.5, 5.0):
        with pytest.raises(DRelayError, match="optimism"):
            cold(bad)
