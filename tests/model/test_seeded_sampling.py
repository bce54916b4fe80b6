"""Seeded sampling (T > 0) commits what autoregressive sampling with the same seed commits, token for
token, whatever is drafted, whatever the verification length, the batch or the arrivals
(`drelay_model/decoding/draws.py`); and the inverse-CDF draw it rests on follows the distribution."""

from __future__ import annotations

import random

import pytest
import torch

from drelay_model.decoding import GenerationConfig, RowDraws, SpeculativeEngine
from drelay_model.decoding.batcher import ContinuousBatcher
from drelay_model.decoding.draws import inverse_cdf
from drelay_model.selectors import default_registry

SETTINGS = (
    {"temperature": 0.9},
    {"temperature": 1.3, "top_p": 0.8},
    {"temperature": 0.7, "top_k": 5},
)


def _settings(i: int, budget: int) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=budget, seed=100 + i, **SETTINGS[i % len(SETTINGS)])


def _ar_alone(target, prompt, settings) -> list[int]:
    batcher = ContinuousBatcher(SpeculativeEngine(target), max_batch=1)
    batcher.submit(prompt, settings)
    return batcher.run()[0]


def test_inverse_cdf_follows_the_distribution_and_skips_zero_mass():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0]])
    n = 20000
    u = torch.rand(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = inverse_cdf(probs.expand(n, -1), u)
    freq = torch.bincount(x, minlength=6).double() / n
    torch.testing.assert_close(freq, probs[0].double(), atol=0.01, rtol=0)
    edge = inverse_cdf(probs, torch.tensor([1.0 - 1e-17], dtype=torch.float64))  # u·total rounds to total
    assert edge.item() == 4  # the last token with mass, never the zero-mass tail


def test_draws_are_peeked_until_committed():
    d = RowDraws(7)
    first = d.token_uniforms(5).clone()
    assert torch.equal(d.token_uniforms(3), first[:3])  # peeking consumes nothing
    d.commit(2)
    assert torch.equal(d.token_uniforms(3), first[2:5])
    assert torch.equal(RowDraws(7).token_uniforms(200)[2:102], (d.token_uniforms(100)))  # chunk refills continue the stream
    assert not torch.equal(RowDraws(8).token_uniforms(5), first)


@pytest.mark.parametrize("seed", [0, 1])
def test_seeded_rows_commit_ar_samples_under_drafts_plans_and_arrivals(
    target, make_drafter, scripted_selector, steep_batch_surface, run_arrivals, seed
):
    """Requests with different sampling settings arrive at random steps; drafts are mostly the AR
    sample (so many are accepted), the batch-aware plan switches between drafted and AR rounds as the
    batch changes. Every request's output is its AR sample with the same seed, alone."""
    rng = random.Random(seed)
    n = 6
    lengths, budgets = [rng.randint(2, 12) for _ in range(n)], [rng.randint(4, 24) for _ in range(n)]
    arrivals = sorted(rng.randint(0, 10) for _ in range(n))
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, target.vocab_size, (k,), generator=g).tolist() for k in lengths]
    reference = [_ar_alone(target, p, _settings(i, budgets[i])) for i, p in enumerate(prompts)]
    drafter = make_drafter(target)
    selector = scripted_selector([p + r for p, r in zip(prompts, reference)], error_rate=0.25, vocab=target.vocab_size)
    engine = SpeculativeEngine(target, drafter, selector)
    engine.costs = steep_batch_surface(engine.num_slots)
    batcher = ContinuousBatcher(engine, max_batch=4)
    streamed: dict[int, list[int]] = {}
    settings = [_settings(i, budgets[i]) for i in range(n)]
    run_arrivals(batcher, prompts, settings, arrivals, lambda u: streamed.setdefault(u.request_id, []).extend(u.new_tokens))
    assert [streamed[i] for i in range(n)] == reference
    stats = batcher.stats
    assert sum(stats.accept_hist[1:]) > 0 and stats.drafted_rounds < stats.rounds  # drafts landed; AR rounds too


@pytest.mark.parametrize("method", ["native", "drelay"])
def test_offline_engine_seeded_sample_equals_ar(target, make_drafter, tiny_selector_config, prompts_of, method):
    """`SpeculativeEngine.generate` at T > 0 with deterministic paths (`draft_sampling` off; a sampled
    path is tested against its proposal instead, an exact draw but not AR's): a batch of prompts with per-row seeds gives each row's
    AR sample (untrained drafters: mostly rejected drafts, row by row or batched)."""
    prompts = prompts_of(target.vocab_size, (4, 9, 6))
    cfg = GenerationConfig(max_new_tokens=16, temperature=0.8, seed=11, draft_sampling=False)
    ar = SpeculativeEngine(target).generate(prompts, cfg).tokens
    drafter = make_drafter(target, top_k=8)
    selector = default_registry().create(method, drafter=drafter, config=tiny_selector_config(method))
    engine = SpeculativeEngine(target, drafter, selector)
    assert engine.generate(prompts, cfg).tokens == ar
    assert [engine.generate([p], cfg, seeds=[cfg.seed + b]).tokens[0] for b, p in enumerate(prompts)] == ar
