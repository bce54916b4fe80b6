"""The batch's state as rows join and leave: `BatchState.merge`, `fill` and `keep` keep every row's
caches, anchor, verified history and pending features its own."""

from __future__ import annotations

import pytest
import torch

from drelay_model.decoding import SpeculativeEngine
from drelay_model.selectors import default_registry


def _engine(target, make_drafter, config):
    drafter = make_drafter(target)
    return SpeculativeEngine(target, drafter, default_registry().create("drelay", drafter=drafter, config=config))


@pytest.mark.parametrize("counts", [None, (2, 0)])  # AR rounds (every row all T), a drafted round's counts
def test_merging_with_pending_features_equals_syncing_first(target, make_drafter, prompts_of, tiny_selector_config,
                                                            counts):  # fmt: skip
    """Rows joining while the running rows' verified features wait for the drafter (AR rounds) get a
    count of 0 in the pending queue; syncing after the merge gives the drafter's context and the
    verified history what syncing before it gives, even where the joining row's prompt is so long
    that the queued positions run past its own cache (the context grows)."""
    engine = _engine(target, make_drafter, tiny_selector_config("drelay"))
    running_p, joining_p = prompts_of(target.vocab_size, (3, 4)), prompts_of(target.vocab_size, (28,))
    F = len(engine.feature_layers) * target.hidden_size
    gen = torch.Generator().manual_seed(0)
    queued = [torch.randn(2, 3, F, generator=gen) for _ in range(6)]  # six rounds' verified features
    c = None if counts is None else torch.tensor(counts)

    def build():
        with torch.inference_mode():
            running, _ = engine.prefill(running_p, [0, 1], capacity=12)
            joining, _ = engine.prefill(joining_p, [2], capacity=30)
        for f in queued:
            running.defer(f, c)
        running.anchor, joining.anchor = torch.tensor([1, 2]), torch.tensor([3])
        return running, joining

    a_run, a_join = build()
    with torch.inference_mode():
        a_run.sync_context(engine.drafter)
        first = a_run.merge(a_join)
        b_run, b_join = build()
        later = b_run.merge(b_join)
        assert later.pending and later.ctx.capacity == 30
        later.sync_context(engine.drafter)
    assert later.ctx.capacity > 30  # row 2 starts at 28 and the queue is 18 (or 12) positions long
    assert torch.equal(later.ctx.lengths, first.ctx.lengths)
    for r, n in enumerate(first.ctx.lengths.tolist()):
        assert torch.equal(later.ctx.k[:, r, :, :n], first.ctx.k[:, r, :, :n])
        assert torch.equal(later.ctx.v[:, r, :, :n], first.ctx.v[:, r, :, :n])
    assert torch.equal(later.history.count, first.history.count)
    assert torch.equal(later.history.feats, first.history.feats)


def test_keeping_rows_moves_the_last_into_the_holes_and_keeps_every_rows_state(target, make_drafter, prompts_of,
                                                                               tiny_selector_config):  # fmt: skip
    """`keep` compacts in place: a kept row past the new batch size moves into a dropped row's slot,
    and every kept row's caches, anchor, history and pending features are its own, wherever it sits."""
    engine = _engine(target, make_drafter, tiny_selector_config("drelay"))
    with torch.inference_mode():
        _check_keep(engine, prompts_of(target.vocab_size, (3, 5, 4, 6, 2)), len(engine.feature_layers) * target.hidden_size)


def _check_keep(engine, prompts, F):
    state, _ = engine.prefill(prompts, [10, 11, 12, 13, 14], capacity=12)
    state.defer(torch.randn(5, 2, F, generator=torch.Generator().manual_seed(0)), torch.tensor([2, 1, 0, 2, 1]))
    state.anchor = torch.tensor([0, 1, 2, 3, 4])
    before = {r: i for i, r in enumerate(state.rows)}
    snap = {name: (c.k.clone(), c.v.clone(), c.lengths.clone()) for name, c in (("cache", state.cache), ("ctx", state.ctx))}
    feats, counts = state.pending[0][0].clone(), state.pending[0][1].clone()
    hist_f, hist_c = state.history.feats.clone(), state.history.count.clone()
    state.keep([10, 12, 14])
    assert state.rows == [10, 14, 12]  # row 14 took row 11's slot; no other row moved
    for name, c in (("cache", state.cache), ("ctx", state.ctx)):
        k, v, lengths = snap[name]
        assert c.k.shape[1] == c.lengths.shape[0] == 3
        for i, r in enumerate(state.rows):
            j = before[r]
            assert c.lengths[i] == lengths[j]
            assert torch.equal(c.k[:, i], k[:, j]) and torch.equal(c.v[:, i], v[:, j])
    for i, r in enumerate(state.rows):
        j = before[r]
        assert state.anchor[i] == j and state.pending[0][1][i] == counts[j]
        assert torch.equal(state.pending[0][0][i], feats[j])
        assert torch.equal(state.history.feats[i], hist_f[j]) and state.history.count[i] == hist_c[j]
    state.keep([14, 12])  # the first row goes: the last moves into its slot
    assert state.rows == [12, 14] and state.anchor.tolist() == [2, 4]
    state.keep([12])  # the last row goes: nothing moves, the batch narrows
    assert state.rows == [12] and state.cache.k.shape[1] == 1 and state.anchor.tolist() == [2]


@pytest.mark.parametrize("counts", [None, (2, 0, 3)])
def test_filling_a_slot_with_pending_features_equals_syncing_first(target, make_drafter, prompts_of, tiny_selector_config,
                                                                   counts):  # fmt: skip
    """A row joining in a finished row's slot while the running rows' features wait for the drafter:
    the slot's pending features are dropped (count 0), so syncing after the fill gives what syncing
    before it gives; the joining prompt needs more capacity than the batch has (the caches grow)."""
    engine = _engine(target, make_drafter, tiny_selector_config("drelay"))
    running_p, joining_p = prompts_of(target.vocab_size, (3, 5, 4)), prompts_of(target.vocab_size, (28,))
    F = len(engine.feature_layers) * target.hidden_size
    gen = torch.Generator().manual_seed(0)
    queued = [torch.randn(3, 3, F, generator=gen) for _ in range(4)]
    c = None if counts is None else torch.tensor(counts)

    def build():
        with torch.inference_mode():
            running, _ = engine.prefill(running_p, [0, 1, 2], capacity=16)
            joining, _ = engine.prefill(joining_p, [3], capacity=30)
        for f in queued:
            running.defer(f, c)
        running.anchor, joining.anchor = torch.tensor([1, 2, 3]), torch.tensor([4])
        return running, joining

    with torch.inference_mode():
        first, a_join = build()
        first.sync_context(engine.drafter)
        first.fill([1], a_join)
        later, b_join = build()
        later.fill([1], b_join)
        assert later.pending and later.cache.capacity == later.ctx.capacity == 30
        later.sync_context(engine.drafter)
    assert later.rows == first.rows == [0, 3, 2] and torch.equal(later.anchor, torch.tensor([1, 4, 3]))
    for cache_a, cache_b in ((first.ctx, later.ctx), (first.cache, later.cache)):
        assert torch.equal(cache_b.lengths, cache_a.lengths)
        for r, n in enumerate(cache_a.lengths.tolist()):
            assert torch.equal(cache_b.k[:, r, :, :n], cache_a.k[:, r, :, :n])
            assert torch.equal(cache_b.v[:, r, :, :n], cache_a.v[:, r, :, :n])
    assert torch.equal(later.history.count, first.history.count)
    assert torch.equal(later.history.feats, first.history.feats)
