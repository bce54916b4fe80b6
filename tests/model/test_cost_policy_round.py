"""A round consults the cost policy once (`CostPolicy.round`); the `PolicyRound` it gets back cuts the
drafted paths and learns from the round. It decides exactly what the policy's own steps decide
(`plan`, `choose`, `observe`, `observe_times`) given the same outcomes and phase times."""

from __future__ import annotations

import random

import pytest
import torch

from drelay_model.decoding import GenerationConfig, SpeculativeEngine
from drelay_model.decoding.cost_policy import CostPolicy, PolicySettings, RoundTimes
from tests.model.test_verify_length import one_row

H = 4


def _surface():
    return one_row(verify_ms=(30.0, 31.0, 33.0, 36.0, 40.0), block_ms=3.0, head_ms=0.5, select_ms=1.0, extend_ms=0.4)


@pytest.mark.parametrize("partial", [True, False])
def test_a_round_decides_what_the_policy_steps_decide(partial):
    """Two policies fed the same synthetic rounds (q, outcomes, phase times): one through its round
    objects, one through the steps a round used to call with the catch-up charged as the surface's
    one-round extension. Plans, cuts and every running estimate agree, round after round."""
    settings = PolicySettings(probe=2)
    by_round, by_steps = (CostPolicy(_surface(), H, settings, native_arm=True) for _ in range(2))
    rng = random.Random(0)
    for _ in range(60):
        rows = rng.choice([1, 2, 3])
        r = by_round.round(rows=rows, partial=partial)
        L = by_steps.plan(partial=partial, batch=rows)
        assert (r.verify_slots, r.runs_selector) == (L, by_steps.use_selector)
        head = 0 if L == 0 else (L if partial or not by_steps.use_selector else H)
        assert r.head_slots == head
        times = RoundTimes(verify_width=1, verify_ms=rng.uniform(25, 45), total_ms=rng.uniform(45, 80))
        q = length = accepted = None
        if L:
            q = torch.tensor([[rng.random() for _ in range(L)] for _ in range(rows)])
            length = r.cut(q)
            assert torch.equal(length, by_steps.choose(q, head))
            G = int(length.max())
            q, accepted = q[:, :G], torch.tensor([rng.randint(0, G) for _ in range(rows)])
            accepted = torch.minimum(accepted, length)
            catch_up = rng.choice([0.4, 0.4, 9.0])  # now and then a catch-up after AR rounds
            times = RoundTimes(verify_width=1 + G, verify_ms=rng.uniform(30, 50), total_ms=rng.uniform(60, 90),
                               drafting_ms=catch_up + rng.uniform(4, 8), catch_up_ms=catch_up)  # fmt: skip
            by_steps.observe(q, length, accepted)
        r.learn(times, q, length, accepted)
        backlog = times.catch_up_ms - by_steps.costs.extend(rows) if L else 0.0
        by_steps.observe_times(verify_width=times.verify_width, verify_ms=times.verify_ms, head_slots=head,
                               decided=L if by_steps.use_selector else 0, draft_ms=times.drafting_ms - backlog,
                               round_ms=times.total_ms - backlog, batch=rows)  # fmt: skip
        assert (by_round.log_draft_scale, by_round.log_verify_scale, by_round.other_ms) == (
            by_steps.log_draft_scale, by_steps.log_verify_scale, by_steps.other_ms)  # fmt: skip
        assert [a.hits for a in by_round.arms] == [a.hits for a in by_steps.arms]


class _Counting(CostPolicy):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.rounds = self.plans = 0

    def round(self, **kw):
        self.rounds += 1
        return super().round(**kw)

    def plan(self, **kw):
        self.plans += 1
        return super().plan(**kw)


def test_the_engine_consults_the_policy_once_per_round(target, make_drafter, prompts_of):
    drafter = make_drafter(target, top_k=16)
    n = drafter.config.num_slots
    surface = one_row(verify_ms=tuple(10.0 + 0.1 * i for i in range(n + 1)), block_ms=0.5, head_ms=0.05, select_ms=0.1)
    engine = SpeculativeEngine(target, drafter, costs=surface)
    engine.policy = policy = _Counting(surface, n)
    out = engine.generate(prompts_of(target.vocab_size, (5, 7)), GenerationConfig(max_new_tokens=12))
    assert policy.rounds == policy.plans == out.stats.steps > 0
