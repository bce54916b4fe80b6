"""Continuous batching: requests joining and leaving between rounds decode exactly as they would alone."""

from __future__ import annotations

import pytest
import torch

from drelay_model.decoding import GenerationConfig, SpeculativeEngine
from drelay_model.decoding.batcher import ContinuousBatcher
from drelay_model.decoding.prefill_groups import PREFILL_WASTE, prefill_groups
from drelay_model.decoding.sampling import filtered_logits
from drelay_model.errors import DRelayError
from drelay_model.selectors import default_registry

LENGTHS = (5, 9, 3, 12, 7)
BUDGETS = (30, 40, 40, 25, 3)  # scripted (high-acceptance) drafts: several rounds each
JOIN_BUDGETS = (10, 14, 12, 8, 3)  # untrained drafters commit ~1 token per round: keep it short


def _staggered(batcher: ContinuousBatcher, prompts, budgets, *, cancel_after: int | None = None):
    """Submit requests at different rounds (0, 0, 1, 3, 4), optionally cancel request 1 midway;
    returns (tokens streamed per request, final updates)."""
    joins = {0: [0, 1], 1: [2], 3: [3], 4: [4]}
    streamed: dict[int, list[int]] = {}
    finals = {}

    def on_update(u):
        streamed.setdefault(u.request_id, []).extend(u.new_tokens)
        if u.finished:
            finals[u.request_id] = u

    step = 0
    while step <= max(joins) or not batcher.idle:
        for b in joins.get(step, []):
            rid = batcher.submit(prompts[b], GenerationConfig(max_new_tokens=budgets[b]), on_update)
            assert rid == b
        if cancel_after is not None and step == cancel_after:
            batcher.cancel(1)
        batcher.step()
        step += 1
    return streamed, finals


def _check_stats(update, tokens):
    s = update.stats
    assert s.accepted + s.bonus == s.committed
    assert s.bonus == s.rounds  # one target token per round
    assert s.generated == len(tokens) == s.committed + 1  # + the prefill token
    assert sum(s.accept_hist) == s.rounds
    assert sum(n * c for n, c in enumerate(s.accept_hist)) == s.accepted
    assert s.tau == pytest.approx(s.committed / s.rounds if s.rounds else 0.0)


@pytest.mark.parametrize("method", ["ar", *default_registry().names()])
def test_joining_requests_decode_as_alone(target, make_engine, prompts_of, tiny_selector_config, method):
    prompts = prompts_of(target.vocab_size, LENGTHS)
    engine = make_engine(target, method, config=tiny_selector_config(method))
    streamed, finals = _staggered(ContinuousBatcher(engine, max_batch=4), prompts, JOIN_BUDGETS)
    for b, p in enumerate(prompts):
        alone = engine.generate([p], GenerationConfig(max_new_tokens=JOIN_BUDGETS[b])).tokens[0]
        assert streamed[b] == alone, f"request {b} differs from decoding it alone"
        assert finals[b].finish_reason == "length"
        _check_stats(finals[b], streamed[b])


@pytest.mark.parametrize("error_rate", [0.0, 0.3])
def test_mostly_right_drafts_with_early_leave(hf_greedy, target, make_engine, prompts_of, scripted_selector, error_rate):
    """High acceptance (every accepted length) while rows join, one is cancelled and others finish."""
    prompts = prompts_of(target.vocab_size, LENGTHS)
    reference = [p + hf_greedy(target, p, 40) for p in prompts]
    selector = scripted_selector(reference, error_rate=error_rate, vocab=target.vocab_size)
    engine = make_engine(target, "native", selector)
    streamed, finals = _staggered(ContinuousBatcher(engine), prompts, BUDGETS, cancel_after=1)
    for b, p in enumerate(prompts):
        expected = reference[b][len(p) : len(p) + BUDGETS[b]]
        if b == 1:
            assert finals[1].finish_reason == "cancelled"
            assert streamed[1] == expected[: len(streamed[1])] and len(streamed[1]) < len(expected)
            continue
        assert streamed[b] == expected
        _check_stats(finals[b], streamed[b])
    if error_rate == 0.0:
        assert finals[0].stats.tau > 10


def test_stop_predicate_and_eos(target, make_engine, prompts_of):
    prompts = prompts_of(target.vocab_size, (6,))
    engine = make_engine(target, "native")
    alone = engine.generate(prompts, GenerationConfig(max_new_tokens=12)).tokens[0]
    stop_tok = alone[7]
    first = alone.index(stop_tok)
    batcher = ContinuousBatcher(engine)
    batcher.submit(prompts[0], GenerationConfig(max_new_tokens=12, stop=lambda toks: toks[-1] == stop_tok))
    batcher.submit(prompts[0], GenerationConfig(max_new_tokens=12))
    out = batcher.run()
    assert out[0] == alone[: first + 1]
    assert out[1] == alone


def test_sampling_is_seeded_and_top_k1_is_greedy(target, make_engine, prompts_of):
    prompts = prompts_of(target.vocab_size, (5, 8))
    engine = make_engine(target, "native")
    greedy = engine.generate(prompts[:1], GenerationConfig(max_new_tokens=10)).tokens[0]
    runs = []
    for _ in range(2):
        batcher = ContinuousBatcher(engine)
        batcher.submit(prompts[0], GenerationConfig(max_new_tokens=10, temperature=0.9, seed=4))
        batcher.submit(prompts[1], GenerationConfig(max_new_tokens=10, temperature=1.5, top_p=0.8, seed=5))
        batcher.submit(prompts[0], GenerationConfig(max_new_tokens=10, temperature=1.0, top_k=1, seed=6))
        runs.append(batcher.run())
    assert runs[0] == runs[1]
    assert runs[0][2] == greedy


def test_filtered_logits_keeps_top_k_and_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    keep = lambda **kw: torch.isfinite(filtered_logits(logits, GenerationConfig(temperature=1.0, **kw)))[0].tolist()  # noqa: E731
    assert keep(top_k=2) == [True, True, False, False]
    assert keep(top_p=0.5) == [True, False, False, False]
    assert keep(top_p=0.81) == [True, True, True, False]
    assert keep() == [True] * 4


def test_capacity_grows_and_shrinks(target, prompts_of):
    engine = SpeculativeEngine(target)
    batcher = ContinuousBatcher(engine)
    short, long = prompts_of(target.vocab_size, (4, 30))
    got: list[int] = []
    batcher.submit(short, GenerationConfig(max_new_tokens=100), lambda u: got.extend(u.new_tokens))
    batcher.step()
    cap0 = batcher._state.cache.capacity
    batcher.submit(long, GenerationConfig(max_new_tokens=600))
    batcher.step()
    assert batcher._state.cache.capacity > cap0  # grew for the longer request
    batcher.cancel(1)
    batcher.step()
    assert batcher._state.cache.capacity == cap0  # shrank when it left
    batcher.run()
    assert got == engine.generate([short], GenerationConfig(max_new_tokens=100)).tokens[0]


@pytest.mark.parametrize(
    "prompt, kwargs, message",
    [
        ([], {}, "prompt is empty"),
        ([1] * 2000, {}, "over the target's context window"),
        ([999999], {}, "token ids outside"),
        ([1], {"max_new_tokens": 0}, "max_new_tokens must be"),
        ([1], {"temperature": -1.0}, "temperature must be"),
        ([1], {"top_p": 0.0}, "top_p must be"),
        ([1], {"top_k": -1}, "top_k must be"),
    ],
)
def test_bad_requests_are_clear_errors(target, prompt, kwargs, message):
    with pytest.raises(DRelayError, match=message):
        ContinuousBatcher(SpeculativeEngine(target)).submit(prompt, GenerationConfig(**kwargs))


@pytest.mark.parametrize("block_ms", [0.1, 1000.0])
def test_cost_aware_length_in_the_batcher_is_lossless(target, make_drafter, prompts_of, block_ms):
    """With measured costs the batcher cuts each round's verification (down to AR rounds when
    drafting never pays); joining requests still decode exactly as alone."""
    from drelay_model.decoding import SpeculativeEngine
    from tests.model.test_verify_length import one_row

    prompts = prompts_of(target.vocab_size, LENGTHS)
    drafter = make_drafter(target, top_k=16)
    H = drafter.config.num_slots
    costs = one_row(verify_ms=tuple(10.0 + i for i in range(H + 1)), block_ms=block_ms, head_ms=0.1, select_ms=0.1)
    engine = SpeculativeEngine(target, drafter, costs=costs)
    streamed, finals = _staggered(ContinuousBatcher(engine, max_batch=4), prompts, JOIN_BUDGETS)
    reference = SpeculativeEngine(target)
    for b, p in enumerate(prompts):
        assert streamed[b] == reference.generate([p], GenerationConfig(max_new_tokens=JOIN_BUDGETS[b])).tokens[0]
        _check_stats(finals[b], streamed[b])


def test_the_batcher_drives_the_engine_through_its_public_phases():
    """No reach-ins: every engine attribute the batcher touches is public (prefill, round, ...)."""
    import ast
    import inspect

    from drelay_model.decoding import batcher

    tree = ast.parse(inspect.getsource(batcher))
    private = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr.startswith("_") and not n.attr.startswith("__")
               and isinstance(n.value, ast.Attribute) and n.value.attr == "engine"]  # fmt: skip
    assert private == []


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_arrivals_under_the_batch_aware_plan_decode_as_ar_alone(
    hf_greedy, target, make_engine, scripted_selector, steep_batch_surface, run_arrivals, seed
):
    """Requests of random prompt lengths and budgets arrive at random steps and leave when done; the
    cost surface makes drafting pay for one row and not for four, so the batch-aware plan switches
    between drafted and AR rounds as the batch changes. Every request's output is the target's own
    greedy continuation of its prompt alone."""
    import random

    rng = random.Random(seed)
    n = 7
    lengths, budgets = [rng.randint(2, 14) for _ in range(n)], [rng.randint(2, 28) for _ in range(n)]
    arrivals = sorted(rng.randint(0, 14) for _ in range(n))
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, target.vocab_size, (k,), generator=g).tolist() for k in lengths]
    reference = [hf_greedy(target, p, budgets[i]) for i, p in enumerate(prompts)]
    selector = scripted_selector([p + r for p, r in zip(prompts, reference)], error_rate=0.3, vocab=target.vocab_size)
    engine = make_engine(target, "native", selector)
    H = engine.num_slots
    engine.costs = steep_batch_surface(H)
    batcher = ContinuousBatcher(engine, max_batch=4)
    streamed: dict[int, list[int]] = {}
    finals = {}

    def on_update(u):
        streamed.setdefault(u.request_id, []).extend(u.new_tokens)
        if u.finished:
            finals[u.request_id] = u

    run_arrivals(batcher, prompts, [GenerationConfig(max_new_tokens=b) for b in budgets], arrivals, on_update)
    for i in range(n):
        assert streamed[i] == reference[i], i
        s = finals[i].stats
        _check_stats(finals[i], streamed[i])
        assert s.drafted_rounds <= s.rounds and s.verified_drafts <= H * s.drafted_rounds
    total = batcher.stats
    assert total.drafted_rounds == sum(finals[i].stats.drafted_rounds for i in range(n))
    assert total.verified_drafts == sum(finals[i].stats.verified_drafts for i in range(n))


def test_prefill_groups_cover_every_prompt_with_bounded_padding():
    lengths = [56, 65, 74, 84, 86, 87, 89, 90, 92, 96, 96, 97, 101, 124, 135, 140]
    groups = prefill_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert len(groups) > 1
    for g in groups:
        sizes = [lengths[i] for i in g]
        assert sizes == sorted(sizes, reverse=True)
        assert max(sizes) * len(sizes) <= (1 + PREFILL_WASTE) * sum(sizes)
    assert prefill_groups([7, 7, 7]) == [[0, 1, 2]]  # equal lengths: one forward
    assert prefill_groups([]) == []
    with pytest.raises(ValueError, match="waste"):
        prefill_groups([3], waste=-0.1)


@pytest.mark.parametrize("method", ["ar", "drelay"])
def test_prompts_admitted_together_in_length_groups_decode_as_alone(target, make_engine, prompts_of,
                                                                    tiny_selector_config, method):  # fmt: skip
    lengths = (40, 3, 21, 20, 4)  # three prefill groups: [40], [21, 20], [4, 3]
    assert len(prefill_groups(list(lengths))) == 3
    prompts = prompts_of(target.vocab_size, lengths)
    engine = make_engine(target, method, config=tiny_selector_config(method))
    batcher = ContinuousBatcher(engine, max_batch=8)
    for p in prompts:
        batcher.submit(p, GenerationConfig(max_new_tokens=9))
    out = batcher.run()
    for b, p in enumerate(prompts):
        assert out[b] == engine.generate([p], GenerationConfig(max_new_tokens=9)).tokens[0], f"request {b}"


@pytest.mark.parametrize("method,temperature", [("ar", 0.0), ("drelay", 0.0), ("drelay", 0.9)])
def test_requests_arriving_as_others_finish_take_their_slots_and_decode_as_alone(target, make_engine, prompts_of,
                                                                                tiny_selector_config, method, temperature,
                                                                                monkeypatch):  # fmt: skip
    """A closed loop, as clients behind an endpoint: each finished request's client submits the next
    one. Rows that finish stay as free slots until the next step, whose admission writes the new
    rows into them (`BatchState.fill`, the caches not re-allocated); every request still decodes as
    it does alone (greedy, or a seeded sample: its own numbers), including one whose prompt needs
    more capacity than the batch has."""
    from drelay_model.decoding.batch_state import BatchState

    fills = []
    real_fill = BatchState.fill
    monkeypatch.setattr(BatchState, "fill", lambda self, pos, other: (fills.append(list(pos)), real_fill(self, pos, other)))
    lengths, budgets = (6, 9, 4, 30, 5, 7, 3), (4, 9, 6, 5, 8, 3, 7)  # rows finish at different rounds
    prompts = prompts_of(target.vocab_size, lengths)
    engine = make_engine(target, method, config=tiny_selector_config(method))
    batcher = ContinuousBatcher(engine, max_batch=3)
    queue, out = list(zip(prompts, budgets)), {}

    def settings(n: int) -> GenerationConfig:
        return GenerationConfig(max_new_tokens=n, temperature=temperature, seed=7)

    def submit_next():
        p, n = queue.pop(0)
        batcher.submit(p, settings(n), on_update)

    def on_update(u):
        out.setdefault(u.request_id, []).extend(u.new_tokens)
        if u.finished and queue:
            submit_next()

    for _ in range(3):
        submit_next()
    while not batcher.idle:
        batcher.step()
    assert fills, "no admission reused a finished row's slot"
    for b, (p, n) in enumerate(zip(prompts, budgets)):
        assert out[b] == engine.generate([p], settings(n)).tokens[0], f"request {b}"


def test_ttft_parts_are_non_negative_sum_to_it_and_show_a_wait_behind_a_full_batch(target, prompts_of):
    """TTFT = queue + prefill + first round; the second request of a one-row batch waits for the
    first to finish, and its queue wait says so."""
    batcher = ContinuousBatcher(SpeculativeEngine(target), max_batch=1)
    finals = {}
    for p in prompts_of(target.vocab_size, (6, 9)):
        batcher.submit(p, GenerationConfig(max_new_tokens=12), lambda u: u.finished and finals.setdefault(u.request_id, u))
    batcher.run()
    for u in finals.values():
        s = u.stats
        parts = (s.time_queue, s.time_prefill, s.time_first_round)
        assert min(parts) >= 0 and s.time_prefill > 0
        assert sum(parts) == pytest.approx(s.time_to_first_token, abs=1e-6)
        assert s.time_to_first_token <= s.time_total
    first, second = finals[0].stats, finals[1].stats
    assert second.time_queue > max(first.time_total - 0.01, first.time_queue)
