"""KVCache's batch reshaping: each method against the same rows built by hand."""

from __future__ import annotations

import pytest
import torch

from drelay_model.kv_cache import KVCache

L, NKV, HD = 2, 2, 4


def _cache(lengths: list[int], capacity: int, *, seed: int) -> KVCache:
    """A cache whose valid entries are random and whose stale ones are zeros (as after real forwards)."""
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(n_layers=L, batch_size=len(lengths), n_kv_heads=NKV, head_dim=HD, capacity=capacity)
    for b, n in enumerate(lengths):
        cache.k[:, b, :, :n] = torch.randn(L, NKV, n, HD, generator=g)
        cache.v[:, b, :, :n] = torch.randn(L, NKV, n, HD, generator=g)
    cache.lengths = torch.tensor(lengths)
    return cache


def _row(cache: KVCache, b: int, capacity: int | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Copies of row b's keys and values (zero-padded to `capacity`), and its length."""
    cap = capacity or cache.capacity
    pad = cap - cache.capacity
    k, v = cache.k[:, b], cache.v[:, b]
    if pad > 0:
        k, v = torch.nn.functional.pad(k, (0, 0, 0, pad)), torch.nn.functional.pad(v, (0, 0, 0, pad))
    return k[:, :, :cap].clone(), v[:, :, :cap].clone(), int(cache.lengths[b])


def _assert_row(cache: KVCache, b: int, expected: tuple[torch.Tensor, torch.Tensor, int]) -> None:
    k, v, n = _row(cache, b)
    assert n == expected[2]
    torch.testing.assert_close(k, expected[0], rtol=0, atol=0)
    torch.testing.assert_close(v, expected[1], rtol=0, atol=0)


def test_concat_stacks_rows_at_the_larger_capacity():
    a, b = _cache([3, 5], 8, seed=0), _cache([7], 12, seed=1)
    out = KVCache.concat([a, b])
    assert (out.batch_size, out.capacity) == (3, 12)
    assert out.lengths.tolist() == [3, 5, 7]
    for r, (src, row) in enumerate([(a, 0), (a, 1), (b, 0)]):
        _assert_row(out, r, _row(src, row, 12))


def test_concat_refuses_caches_of_another_shape():
    other = KVCache(n_layers=L, batch_size=1, n_kv_heads=NKV, head_dim=HD + 1, capacity=8)
    with pytest.raises(ValueError, match="differ"):
        KVCache.concat([_cache([1], 8, seed=0), other])


def test_compact_rows_moves_kept_rows_into_holes_and_narrows_the_batch():
    cache = _cache([2, 3, 4, 5, 6], 8, seed=2)
    rows = [_row(cache, b) for b in range(5)]
    # keep rows 0, 3, 4 of 5: row 3 moves into slot 1, row 4 into slot 2
    cache.compact_rows(3, holes=[1, 2], movers=[3, 4])
    assert cache.batch_size == 3
    for slot, src in enumerate([0, 3, 4]):
        _assert_row(cache, slot, rows[src])


def test_compact_rows_without_holes_only_narrows():
    cache = _cache([2, 3, 4], 8, seed=3)
    first = _row(cache, 0)
    storage = cache.k.data_ptr()
    cache.compact_rows(1, holes=[], movers=[])
    assert cache.batch_size == 1 and cache.k.data_ptr() == storage  # a view, nothing copied
    _assert_row(cache, 0, first)


def test_compact_rows_rejects_a_mover_inside_the_kept_rows():
    with pytest.raises(ValueError, match="movers"):
        _cache([1, 1, 1], 4, seed=0).compact_rows(2, holes=[0], movers=[1])


def test_write_rows_in_place_zeroes_the_tail_and_keeps_storage():
    cache, src = _cache([6, 6, 6], 8, seed=4), _cache([2, 3], 4, seed=5)
    untouched = _row(cache, 1)
    storage = cache.k.data_ptr()
    cache.write_rows(torch.tensor([2, 0]), src)
    assert cache.k.data_ptr() == storage and cache.capacity == 8
    _assert_row(cache, 2, _row(src, 0, 8))  # positions 4..7 of the old row are zeros now
    _assert_row(cache, 0, _row(src, 1, 8))
    _assert_row(cache, 1, untouched)


def test_write_rows_grows_for_a_longer_source():
    cache, src = _cache([3, 4], 4, seed=6), _cache([9], 10, seed=7)
    kept = _row(cache, 0, 10)
    cache.write_rows(torch.tensor([1]), src)
    assert cache.capacity == 10
    _assert_row(cache, 1, _row(src, 0))
    _assert_row(cache, 0, kept)


def test_resize_grows_with_zeros_and_shrinks_to_the_longest_row():
    cache = _cache([3, 5], 6, seed=8)
    before = [_row(cache, b, 9) for b in range(2)]
    cache.resize(9)
    assert cache.capacity == 9 and cache.k.shape[3] == 9
    for b in range(2):
        _assert_row(cache, b, before[b])
    cache.resize(5)
    assert cache.capacity == 5 and cache.k.shape[3] == 5 and cache.k.is_contiguous()
    for b in range(2):
        k, v, n = before[b]
        _assert_row(cache, b, (k[:, :, :5], v[:, :, :5], n))
    with pytest.raises(ValueError, match="a row holds 5"):
        cache.resize(4)


def test_a_reshaped_cache_still_serves_a_forward():
    """After concat + compact + resize, begin/append/end write where the lengths say."""
    cache = KVCache.concat([_cache([2], 4, seed=9), _cache([3, 1], 6, seed=10)])
    cache.compact_rows(2, holes=[0], movers=[2])  # rows: old 2 (length 1), old 1 (length 3)
    cache.resize(8)
    positions, mask = cache.begin(2)
    assert positions.tolist() == [[1, 2], [3, 4]]
    k_new = torch.ones(2, NKV, 2, HD)
    k, _ = cache.append(0, k_new, k_new)
    cache.append(1, k_new, k_new)
    cache.end()
    assert cache.lengths.tolist() == [3, 5]
    assert bool((k[0, :, 1:3] == 1).all()) and bool((k[1, :, 3:5] == 1).all())
    assert mask.shape == (2, 1, 2, 5)
