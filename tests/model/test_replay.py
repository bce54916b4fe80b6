"""Greedy replay reproduces real decoding round for round."""

from __future__ import annotations

import pytest

from drelay_model.decoding import GenerationConfig, SpeculativeEngine, replay
from drelay_model.selectors import NativeSelector


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
