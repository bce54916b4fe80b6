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


class _FixedLength:
    """A cost policy that always plans L verified drafts over `heads` drafted slots: the engine's
    cost-aware round at one length, so replay's `verify_slots`/`head_slots` can be checked against it."""

    runs_selector = True

    def __init__(self, L: int, heads: int):
        self.verify_slots, self.head_slots = L, heads

    def round(self, *, rows: int, partial: bool) -> "_FixedLength":
        return self

    def cut(self, q: torch.Tensor) -> torch.Tensor:
        return torch.full((q.shape[0],), self.verify_slots, dtype=torch.long, device=q.device)

    def learn(self, *args, **kwargs) -> None:
        pass


@pytest.mark.parametrize("name", ["native", "drelay"])
@pytest.mark.parametrize(("L", "heads"), [(1, 1), (3, 3), (3, None), (5, 9)])
def test_replay_at_a_fixed_length_equals_the_engines_rounds(
    target, make_drafter, prompts_of, tiny_selector_config, name, L, heads
):
    """replay(verify_slots=L, head_slots=h) is the engine's round that drafts h slots (a partial block,
    or the whole one when h = H) and verifies at most L: same rounds, histogram and tokens."""
    prompts = prompts_of(target.vocab_size, (5, 9, 3))
    drafter = make_drafter(target, top_k=32)
    H = drafter.config.num_slots
    heads = H if heads is None else heads
    torch.manual_seed(0)
    selector = default_registry().create(name, drafter=drafter, config=tiny_selector_config(name)).eval()
    cfg = GenerationConfig(max_new_tokens=30)
    greedy = SpeculativeEngine(target).generate(prompts, cfg).tokens
    engine = SpeculativeEngine(target, drafter, selector)
    real = []
    for p in prompts:  # one row at a time: a round's verify width is the batch's longest path
        engine.policy = _FixedLength(L, heads)
        real.append(engine.generate([p], cfg))
    assert [r.tokens[0] for r in real] == greedy
    replayed = replay(target, drafter, prompts, greedy, selector=selector, verify_slots=L, head_slots=heads)
    assert replayed.rounds == sum(r.stats.rounds for r in real)
    assert replayed.accept_hist.tolist() == sum(r.stats.accept_hist for r in real).tolist()
    assert int(replayed.accept_hist[L + 1 :].sum()) == 0  # never more than L accepted


def test_replay_rejects_bad_lengths(target, make_drafter):
    drafter = make_drafter(target)
    H = drafter.config.num_slots
    for L, heads in ((0, None), (H + 1, None), (4, 3), (2, H + 1)):
        with pytest.raises(ValueError, match="verify_slots"):
            replay(target, drafter, [[1, 2]], [[3, 4]], verify_slots=L, head_slots=heads)
