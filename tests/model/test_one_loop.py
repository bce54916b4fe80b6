"""One decoding loop: `SpeculativeEngine.generate` is a static batch run by the continuous batcher, so
every `GenerationConfig` field (filters, stop, draft sampling, seeds) means the same in `generate`
and for a batcher request, and the statistics come from one place."""

from __future__ import annotations

import pytest
import torch

from drelay_model.decoding import GenerationConfig, SpeculativeEngine
from drelay_model.decoding.batcher import ContinuousBatcher
from drelay_model.selectors import NativeSelector, default_registry


def _alone(engine, prompt, settings) -> list[int]:
    batcher = ContinuousBatcher(engine, max_batch=1)
    batcher.submit(prompt, settings)
    return batcher.run()[0]


def _native_engine(target, make_drafter, selector=None):
    drafter = make_drafter(target, top_k=8)
    return SpeculativeEngine(target, drafter, selector or NativeSelector())


def test_generate_applies_stop_and_filters_as_a_batcher_request(target, make_drafter, prompts_of):
    """T > 0 with top-p, top-k and a stop predicate: each row of `generate` is what the batcher
    gives the same request alone (its seed config.seed + b), and AR's sample with that seed."""
    prompts = prompts_of(target.vocab_size, (4, 9, 6))
    stop = lambda ids: len(ids) >= 3 and ids[-1] % 4 == 0  # noqa: E731
    cfg = GenerationConfig(max_new_tokens=24, temperature=0.9, top_p=0.9, top_k=12, seed=21, stop=stop)
    engine = _native_engine(target, make_drafter)
    rows = engine.generate(prompts, cfg).tokens
    for b, p in enumerate(prompts):
        request = cfg.with_seed(cfg.seed + b)
        assert rows[b] == _alone(engine, p, request) == _alone(SpeculativeEngine(target), p, request)
    stopped = [r for r in rows if len(r) < cfg.max_new_tokens]
    assert stopped and all(stop(r) and not any(stop(r[:k]) for k in range(1, len(r))) for r in stopped)


@pytest.mark.parametrize("method", ["native", "drelay"])
def test_generate_stops_greedy_rows_where_the_predicate_fires(
    hf_greedy, target, make_drafter, prompts_of, tiny_selector_config, method
):
    """Greedy: a stop predicate ends each row right after the token that made it true, whatever was
    drafted past it in the same round."""
    prompts = prompts_of(target.vocab_size, (5, 8))
    refs = [hf_greedy(target, p, 20) for p in prompts]
    ends = {b: ref[6] for b, ref in enumerate(refs)}  # stop at the 7th token's first occurrence
    drafter = make_drafter(target)
    engine = SpeculativeEngine(
        target, drafter, default_registry().create(method, drafter=drafter, config=tiny_selector_config(method))
    )
    for b, p in enumerate(prompts):
        out = engine.generate([p], GenerationConfig(max_new_tokens=20, stop=lambda ids, e=ends[b]: ids[-1] == e)).tokens[0]
        assert out == refs[b][: refs[b].index(ends[b]) + 1]


class _CountingNative(NativeSelector):
    """The native selector, counting the rows it sampled paths for (the code around it is the test)."""

    def __init__(self) -> None:
        super().__init__()
        self.sampled_rows = 0

    def sample(self, block, ctx, *, temperature, generators):
        self.sampled_rows += block.cand_ids.shape[0]
        return super().sample(block, ctx, temperature=temperature, generators=generators)


def test_batcher_honours_draft_sampling_in_a_mixed_batch(target, make_drafter, prompts_of):
    """One batch of a greedy row, a match-rule row and two sampled-path rows (two temperatures, one
    filtered): each row commits what it commits alone; the match-rule and greedy rows are AR's;
    the batcher drew paths for the sampled rows only, and a sampled-path request is `generate`'s."""
    prompts = prompts_of(target.vocab_size, (5, 7, 4, 6))
    settings = [
        GenerationConfig(max_new_tokens=16),
        GenerationConfig(max_new_tokens=16, temperature=0.8, seed=3),
        GenerationConfig(max_new_tokens=16, temperature=1.0, seed=4, draft_sampling=True),
        GenerationConfig(max_new_tokens=16, temperature=0.7, top_k=6, seed=5, draft_sampling=True),
    ]
    selector = _CountingNative()
    engine = _native_engine(target, make_drafter, selector)
    batcher = ContinuousBatcher(engine, max_batch=4)
    ids = [batcher.submit(p, s) for p, s in zip(prompts, settings)]
    together = batcher.run()
    drawn = selector.sampled_rows
    assert drawn > 0
    alone = [_alone(engine, p, s) for p, s in zip(prompts, settings)]
    assert [together[i] for i in ids] == alone
    ar = SpeculativeEngine(target)
    assert alone[:2] == [_alone(ar, p, s) for p, s in zip(prompts[:2], settings[:2])]
    assert alone[2] == engine.generate([prompts[2]], settings[2]).tokens[0]
    sampled_ar = [_alone(ar, p, s) for p, s in zip(prompts[2:], settings[2:])]
    assert sampled_ar != alone[2:]  # tested against the proposal: an exact draw, but not AR's
    matched = GenerationConfig(max_new_tokens=16, temperature=1.0, seed=4)
    before = selector.sampled_rows
    assert _alone(engine, prompts[2], matched) == _alone(ar, prompts[2], matched)
    assert selector.sampled_rows == before  # draft_sampling off: no path drawn


def test_generate_statistics_are_the_batchers(target, make_drafter, prompts_of):
    """A static batch through `generate` records what the same requests record in a batcher."""
    prompts = prompts_of(target.vocab_size, (5, 9, 3, 12))
    engine = _native_engine(target, make_drafter)
    cfg = GenerationConfig(max_new_tokens=12)
    result = engine.generate(prompts, cfg)
    batcher = ContinuousBatcher(engine, max_batch=4)
    for b, p in enumerate(prompts):
        batcher.submit(p, cfg.with_seed(cfg.seed + b))
    batcher.run()
    a, b = result.stats.to_dict(), batcher.stats.to_dict()
    counts = ("committed", "rounds", "steps", "drafted_steps", "drafted_rounds", "verified_drafts", "generated", "requests")
    assert {k: a[k] for k in counts} == {k: b[k] for k in counts} and a["accept_hist"] == b["accept_hist"]
    assert a["requests"] == 4 and a["generated"] == sum(len(t) for t in result.tokens) == a["committed"] + 4
    assert torch.equal(result.stats.accept_hist, batcher.stats.accept_hist)
    assert result.stats.time_total >= result.stats.time_prefill + result.stats.time_verify > 0
