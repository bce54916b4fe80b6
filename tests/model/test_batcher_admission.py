"""The continuous batcher under a prefill budget (`engine.prefill_budget`): each step prefills at
most the budget's prompt tokens, first in first out, prompts longer than the budget in chunks over
several steps, and every output is the one decoded alone."""

from __future__ import annotations

import pytest

from drelay_model.decoding import GenerationConfig
from drelay_model.decoding.batcher import ContinuousBatcher
from drelay_model.errors import DRelayError


def _budgeted_run(engine, prompts, settings, budget, max_batch, monkeypatch):
    """All prompts submitted at once to a batcher with a prefill budget; returns (outputs, prompt
    tokens prefilled per step, steps that ran a round, steps with running rows, the step each request's
    prefill began in, by request)."""
    per_step, first_step = [], {}
    real = engine.prefill

    def spy(prompts, rows, capacity, into=None):
        per_step[-1] += sum(len(p) for p in prompts)
        for r in rows:
            first_step.setdefault(r, len(per_step))
        return real(prompts, rows, capacity, into=into)

    monkeypatch.setattr(engine, "prefill", spy)
    batcher = ContinuousBatcher(engine, max_batch=max_batch, prefill_budget=budget)
    for p in prompts:
        batcher.submit(p, settings)
    out, rounds, busy = {}, 0, 0
    while not batcher.idle:
        per_step.append(0)
        running_before = batcher.num_running
        steps_before = batcher.stats.steps
        for u in batcher.step():
            out.setdefault(u.request_id, []).extend(u.new_tokens)
        busy += running_before > 0
        rounds += running_before > 0 and batcher.stats.steps > steps_before
    return out, per_step, rounds, busy, [first_step[i] for i in sorted(first_step)]


@pytest.mark.parametrize("method,temperature", [("ar", 0.0), ("drelay", 0.0), ("drelay", 0.9)])
def test_a_prefill_budget_bounds_each_step_keeps_fifo_and_decodes_as_alone(target, make_engine, prompts_of,
                                                                           tiny_selector_config, method, temperature,
                                                                           monkeypatch):  # fmt: skip
    """A burst of prompts (one longer than the budget: prefilled in chunks over three steps) under a
    budget of 16 prompt tokens per step: no step prefills more, the running rows decode at every
    step, requests are admitted in arrival order, and every output is the one decoded alone
    (greedy, or a seeded sample)."""
    lengths = (5, 9, 3, 40, 7, 12, 2)
    prompts = prompts_of(target.vocab_size, lengths)
    engine = make_engine(target, method, config=tiny_selector_config(method))
    settings = GenerationConfig(max_new_tokens=8, temperature=temperature, seed=3)
    out, per_step, rounds, busy, began = _budgeted_run(engine, prompts, settings, 16, 4, monkeypatch)
    assert max(per_step) <= 16 and sum(per_step) == sum(lengths)
    assert rounds == busy  # no step with running rows went without its round
    assert began == sorted(began) and len(set(began)) > 2  # first in, first prefilled, over several steps
    monkeypatch.undo()
    for b, p in enumerate(prompts):
        assert out[b] == engine.generate([p], settings.with_seed(3)).tokens[0], f"request {b}"


@pytest.mark.parametrize("method", ["ar", "drelay"])
def test_a_chunked_prompt_may_end_in_the_step_the_next_one_starts(target, make_engine, prompts_of,
                                                                  tiny_selector_config, method, monkeypatch):  # fmt: skip
    """Two prompts longer than the budget in a row: the first's last chunk (4 tokens) and the second's
    first chunk (the 12 left) share a step; both join the batch and decode as alone."""
    lengths = (20, 30, 3)
    prompts = prompts_of(target.vocab_size, lengths)
    engine = make_engine(target, method, config=tiny_selector_config(method))
    settings = GenerationConfig(max_new_tokens=6)
    out, per_step, rounds, busy, began = _budgeted_run(engine, prompts, settings, 16, 4, monkeypatch)
    assert per_step[:2] == [16, 16] and began[:2] == [1, 2] and sum(per_step) == sum(lengths)
    assert rounds == busy
    monkeypatch.undo()
    for b, p in enumerate(prompts):
        assert out[b] == engine.generate([p], settings).tokens[0], f"request {b}"


def test_admission_plan_fills_the_budget_in_order_and_chunks_only_what_cannot_fit():
    from drelay_model.decoding.admission import AdmissionPlan, check_budget, plan_admission

    assert plan_admission(None, [5, 9, 3], 8, None) == AdmissionPlan(whole=3)
    assert plan_admission(None, [5, 9, 3], 2, None) == AdmissionPlan(whole=2)  # the batch's room
    assert plan_admission(None, [5, 9, 3], 8, 16) == AdmissionPlan(whole=2)  # 14 of 16: the 3 waits its turn (FIFO)
    assert plan_admission(None, [9, 9], 8, 16) == AdmissionPlan(whole=1)  # the second goes first next step
    assert plan_admission(None, [5, 40, 3], 8, 16) == AdmissionPlan(whole=1, start_tokens=11)  # too long: chunks
    assert plan_admission(29, [3], 8, 16) == AdmissionPlan(continue_tokens=16)  # nothing passes a chunked prompt
    assert plan_admission(13, [3, 2], 8, 16) == AdmissionPlan(continue_tokens=13, whole=1)
    assert plan_admission(4, [30, 3], 8, 16) == AdmissionPlan(continue_tokens=4, start_tokens=12)  # one ends, one starts
    assert plan_admission(None, [], 8, 16) == AdmissionPlan()
    for bad in (0, -3, 1.5, True):
        with pytest.raises(DRelayError, match="prefill_budget"):
            check_budget(bad)
