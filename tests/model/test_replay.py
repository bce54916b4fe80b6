"""Greedy replay reproduces real decoding round for round."""

from __future__ import annotations

import pytest
import torch

from drelay_model.decoding import GenerationConfig, SpeculativeEngine, replay
from drelay_model.selectors import NativeSelector
from drelay_model.selectors.registry import default_registry


@pytest.mark.parametrize("error_rate", [None, 0.2])
def test_replay_tau_equals_real_decoding(target, make_drafter, prompts_of, scripted_selector, error_rate):
    prompts = prompts_of(target.vocab_size, (5, 9, 3, 12))
    drafter = make_drafter(target, top_k=32)
    cfg = GenerationConfig(max_new_tokens=40)
    greedy = SpeculativeEngine(target).generate(prompts, cfg).tokens
    if error_rate is None:
        make = NativeSelector
    else:  # a path that is mostly right, so rounds accept many tokens
        reference = [p + g for p, g in zip(prompts, greedy)]
        make = lambda: scripted_selector(reference, error_rate=error_rate, seed=4, vocab=target.vocab_size)  # noqa: E731
    real = SpeculativeEngine(target, drafter, make()).generate(prompts, cfg)
    assert real.tokens == greedy
    replayed = replay(target, drafter, prompts, greedy, selector=make())
    assert replayed.rounds == real.stats.rounds
    assert replayed.committed == real.stats.committed
    assert replayed.tau == pytest.approx(real.stats.tau, abs=0)
    assert replayed.accept_hist.tolist() == real.stats.accept_hist.tolist()


def test_oracle_tau_bounds_native(target, make_drafter, prompts_of):
    prompts = prompts_of(target.vocab_size, (6, 10))
    drafter = make_drafter(target, top_k=64)
    greedy = SpeculativeEngine(target).generate(prompts, GenerationConfig(max_new_tokens=40)).tokens
    native = replay(target, drafter, prompts, greedy)
    oracle = replay(target, drafter, prompts, greedy, oracle=True)
    assert oracle.tau >= native.tau
    assert oracle.tau > 1.0  # a 64-of-256 pool holds the target's token often enough


@pytest.mark.parametrize("name", default_registry().names())
def test_batched_replay_equals_one_prompt_at_a_time(target, make_drafter, prompts_of, tiny_selector_config, name):
    """Rows replayed together (different lengths, finishing at different rounds) give each prompt the
    rounds it gets alone: same counters, same histogram, same per-round trace."""
    prompts = prompts_of(target.vocab_size, (5, 14, 3, 9, 7))
    drafter = make_drafter(target, top_k=32)
    torch.manual_seed(0)
    selector = default_registry().create(name, drafter=drafter, config=tiny_selector_config(name)).eval()
    greedy = SpeculativeEngine(target).generate(prompts, GenerationConfig(max_new_tokens=30)).tokens

    def run(batch_size):
        trace = []
        hook = lambda r: trace.append((r.row, r.anchor_pos, r.path.tolist(), r.accepted, r.committed))  # noqa: E731
        stats = replay(target, drafter, prompts, greedy, selector=selector, on_round=hook, batch_size=batch_size)
        return stats, sorted(trace)

    alone, alone_trace = run(1)
    together, together_trace = run(4)
    assert together_trace == alone_trace
    for field in ("rounds", "committed", "steps", "generated"):
        assert getattr(together, field) == getattr(alone, field), field
    assert together.accept_hist.tolist() == alone.accept_hist.tolist()
    oracle_alone = replay(target, drafter, prompts, greedy, oracle=True, batch_size=1)
    oracle_together = replay(target, drafter, prompts, greedy, oracle=True, batch_size=3)
    assert oracle_together.accept_hist.tolist() == oracle_alone.accept_hist.tolist()


def test_replay_rejects_bad_arguments(target, make_drafter, prompts_of):
    drafter = make_drafter(target)
    with pytest.raises(ValueError, match="batch_size"):
        replay(target, drafter, [[1, 2]], [[3, 4]], batch_size=0)
    with pytest.raises(ValueError, match="continuations"):
        replay(target, drafter, [[1, 2]], [], batch_size=2)
