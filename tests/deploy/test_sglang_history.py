"""The plugin worker's per-request ring buffer reads exactly what the engine's VerifiedHistory holds
for the same commits (any interleaving of requests, prefills longer than N, slot reuse), and it
compiles as one graph."""

from __future__ import annotations

import torch

from deploy.sglang.history import RequestFeatureRing
from drelay_model.decoding.history import VerifiedHistory


def test_ring_reads_what_the_engine_history_holds():
    g = torch.Generator().manual_seed(0)
    R, N, Fd = 5, 6, 3
    ring = RequestFeatureRing(R, N, Fd)
    engine = {r: VerifiedHistory(1, N, Fd) for r in range(R)}  # one engine row per request
    for step in range(40):
        B = int(torch.randint(1, R + 1, (1,), generator=g))
        slots = torch.randperm(R, generator=g)[:B]
        T = 10 if step % 7 == 0 else 4  # a prefill longer than N now and then
        feats = torch.randn(B, T, Fd, generator=g)
        n_new = torch.randint(0, T + 1, (B,), generator=g)
        if step == 20:  # request slot reuse: a new request starts empty
            ring.reset(slots[:1])
            engine[int(slots[0])] = VerifiedHistory(1, N, Fd)
        ring.append(slots, feats, n_new)
        for b, s in enumerate(slots.tolist()):
            engine[s].push(feats[b : b + 1], n_new[b : b + 1])
        got, mask = ring.read(torch.arange(R))
        for s in range(R):
            assert torch.equal(got[s], engine[s].feats[0]), f"step {step} slot {s}"
            assert torch.equal(mask[s], engine[s].mask()[0])


def test_ring_append_and_read_compile_as_one_graph():
    torch._dynamo.reset()
    ring = RequestFeatureRing(4, 5, 2)

    def step(slots, feats, n_new):
        ring.append(slots, feats, n_new)
        return ring.read(slots)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    feats, mask = compiled(torch.tensor([2, 0]), torch.ones(2, 3, 2), torch.tensor([3, 1]))
    assert mask.sum(1).tolist() == [3, 1] and feats[0, -3:].eq(1).all()
    torch._dynamo.reset()
