"""A captured CUDA graph reads the storages it saw at capture: every input of the `graphs` step's
round (benchmarks/gpu/check_graphs.py) must keep its storage while new inputs are written, and the
KV cache's lengths must change in place (`end`, `crop`). Checked on CPU by data_ptr."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gpu.check_graphs import SHAPES, StaticRound, build
from drelay_model.kv_cache import KVCache


def _cache(B: int = 3) -> KVCache:
    return KVCache(n_layers=2, batch_size=B, n_kv_heads=1, head_dim=4, capacity=16)


def _forward(cache: KVCache, T: int) -> None:
    """One forward of T tokens per row through begin → append (each layer) → end."""
    positions, _ = cache.begin(T)
    B = cache.batch_size
    for layer in range(2):
        new = positions[:, None, :, None].float().expand(B, 1, T, 4) + layer
        cache.append(layer, new, -new)
    cache.end()


def test_kv_cache_updates_lengths_k_and_v_in_place():
    cache = _cache()
    ptrs = [t.data_ptr() for t in (cache.k, cache.v, cache.lengths)]
    _forward(cache, 5)  # uniform rows: the slice path
    new_lengths = torch.tensor([2, 5, 3])
    cache.crop(new_lengths)
    new_lengths[0] = 0  # the cache took a copy
    assert cache.lengths.tolist() == [2, 5, 3]
    _forward(cache, 4)  # ragged rows: the scatter path
    assert cache.lengths.tolist() == [6, 9, 7]
    assert [t.data_ptr() for t in (cache.k, cache.v, cache.lengths)] == ptrs
    # Values where they belong: row 0 holds positions 0, 1 of the first forward, then 2..5 of the second.
    assert cache.k[1, 0, 0, :6, 0].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert cache.v[0, 2, 0, :7, 0].tolist() == [-0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0]


def test_kv_cache_crop_refuses_bad_lengths_and_keeps_the_old_ones():
    cache = _cache()
    _forward(cache, 3)
    with pytest.raises(ValueError, match="outside"):
        cache.crop(torch.tensor([1, 4, 2]))
    with pytest.raises(ValueError, match="shape"):
        cache.crop(torch.tensor([1]))
    assert cache.lengths.tolist() == [3, 3, 3]
    cache.select_rows(torch.tensor([2, 0]))  # the batch shrinks: new tensors, as documented
    assert cache.lengths.tolist() == [3, 3] and cache.k.shape[1] == 2


def test_every_captured_input_of_the_graphs_round_keeps_its_storage_across_rounds():
    s = SHAPES["tiny"]
    drafter, selector = build(s, "cpu")
    vocab = drafter.embed_weight.shape[0]
    rnd = StaticRound(drafter, selector, batch=s["batches"][0], capacity=s["capacity"])
    rnd.fill(0, vocab)
    inputs = rnd.captured_inputs()
    ptrs = {name: t.data_ptr() for name, t in inputs.items()}
    seen_lengths, seen_anchors = [], []
    for seed in (1, 2, 3):
        rnd.fill(seed, vocab)
        rnd()  # a round reads them (and must not replace them either)
        assert {name: t.data_ptr() for name, t in rnd.captured_inputs().items()} == ptrs
        seen_lengths.append(inputs["context lengths"].tolist())  # the tensor captured first
        seen_anchors.append(inputs["anchor_ids"].tolist())
    # The inputs did change between rounds, through the captured storages.
    assert len({tuple(x) for x in seen_lengths}) > 1 and len({tuple(x) for x in seen_anchors}) > 1
    assert inputs["anchor_pos"].tolist() == rnd.cache.lengths.tolist() == seen_lengths[-1]
