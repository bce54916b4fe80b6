"""The `engine` backend without Ray: streamed chunks carry the request's spec statistics, and a
request whose stream is never read (client gone before the first byte) still frees its slot."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from deploy.serve.backends.base import TTFT_PARTS, GenRequest, Overloaded
from deploy.serve.backends.engine import EngineBackend
from deploy.serve.config import parse_config
from drelay_model.decoding import GenerationConfig


@pytest.fixture(scope="module")
def backend():
    cfg = parse_config(
        {
            "model_id": "t",
            "engine": {
                "target": "tiny-llama",
                "tokenizer": "smollm2-135m",
                "method": "native",
                "random_drafter": True,
                "max_batch": 1,
            },
            "limits": {"max_waiting": 1},
        }
    )
    b = EngineBackend(cfg.engine, cfg.limits)
    yield b
    b.shutdown()


def test_stream_and_slots(backend):
    async def run():
        unread = backend.submit(GenRequest(prompt_ids=[1, 2, 3], settings=GenerationConfig(max_new_tokens=8)))
        chunks = [c async for c in backend.submit(GenRequest(prompt_ids=[4, 5], settings=GenerationConfig(max_new_tokens=6)))]
        for _ in range(200):
            if not backend._queues:
                break
            await asyncio.sleep(0.05)
        del unread
        return chunks

    chunks = asyncio.run(run())
    assert sum(len(c.token_ids) for c in chunks) == 6 == chunks[-1].spec.completion_tokens
    assert chunks[-1].finish_reason == "length" and chunks[-1].spec.verify_ct == sum(chunks[-1].spec.accept_histogram)
    assert not backend._queues  # both slots freed, the unread one included
    ext = chunks[-1].spec.sglext("ar")
    assert all(ext[k] >= 0 for k in TTFT_PARTS) and ext["prefill_time_s"] > 0  # the engine's TTFT, split


def test_overloaded_beyond_batch_plus_waiting(backend):
    async def run():
        backend.submit(GenRequest(prompt_ids=[1], settings=GenerationConfig(max_new_tokens=200)))
        backend.submit(GenRequest(prompt_ids=[2], settings=GenerationConfig(max_new_tokens=200)))
        with pytest.raises(Overloaded, match="max_batch 1 \\+ max_waiting 1"):
            backend.submit(GenRequest(prompt_ids=[3], settings=GenerationConfig(max_new_tokens=5)))

    asyncio.run(run())


def test_registry_references_pass_through_config_path_resolution():
    from deploy.serve.backends.engine import _repo_path

    assert _repo_path("models:/drelay-smollm2@champion") == "models:/drelay-smollm2@champion"
    assert Path(_repo_path("checkpoints/smollm2-135m")).is_dir()  # relative to the repository root


def test_a_closed_event_loop_does_not_end_the_batcher_thread(backend):
    """Updates for a request whose event loop has closed (the replica shutting down, or the caller's
    `asyncio.run` over) are dropped: an engine failure delivered to such a request must not raise
    `RuntimeError: Event loop is closed` out of the batcher thread (which would end it, unhandled)."""
    import threading
    import time

    closed, raised = threading.Event(), []
    previous_hook = threading.excepthook
    threading.excepthook = raised.append

    def stop_after_close(ids: list[int]) -> bool:  # runs on the batcher thread, inside a round
        closed.wait(30)
        raise ValueError("engine failure after the caller's loop closed")

    async def submit():
        backend.submit(GenRequest(prompt_ids=[7, 8, 9], settings=GenerationConfig(max_new_tokens=4, stop=stop_after_close)))

    async def healthy():
        return [c async for c in backend.submit(GenRequest(prompt_ids=[4, 5], settings=GenerationConfig(max_new_tokens=3)))]

    def drained() -> None:  # requests left by earlier tests (their loops closed) are dropped at their next round
        for _ in range(1200):
            if not backend._queues:
                return
            time.sleep(0.05)

    try:
        drained()
        loop = asyncio.new_event_loop()
        loop.run_until_complete(submit())
        loop.close()
        closed.set()
        drained()  # the engine failure has been handled (its request dropped)
        chunks = asyncio.run(asyncio.wait_for(healthy(), 120))  # the same thread still serves
    finally:
        threading.excepthook = previous_hook
    assert not raised and backend._thread.is_alive()
    assert sum(len(c.token_ids) for c in chunks) == 3 and chunks[-1].finish_reason == "length"


def _drained(backend) -> None:
    """Wait until the requests earlier tests left behind have finished (their loops are closed)."""
    import time

    for _ in range(1200):
        if not backend._queues and backend.batcher.idle:
            return
        time.sleep(0.05)


def test_the_endpoint_path_decodes_as_generate(backend):
    """The endpoint's loop and `generate` are one loop: a seeded T > 0 request with top-p, top-k and a
    stop predicate, and a greedy one with the same predicate, stream what `SpeculativeEngine.generate`
    returns for the same prompt and settings (and a seeded sample is AR's)."""
    from drelay_model.decoding import SpeculativeEngine

    stop = lambda ids: len(ids) >= 2 and ids[-1] % 5 == 0  # noqa: E731
    cases = [
        ([3, 1, 4, 1, 5], GenerationConfig(max_new_tokens=12, temperature=0.9, top_p=0.9, top_k=20, seed=8, stop=stop)),
        ([2, 7, 1, 8], GenerationConfig(max_new_tokens=10, stop=stop)),
    ]

    async def serve(prompt, settings):
        return [c async for c in backend.submit(GenRequest(prompt_ids=prompt, settings=settings))]

    _drained(backend)
    reasons = []
    for prompt, settings in cases:
        chunks = asyncio.run(asyncio.wait_for(serve(prompt, settings), 120))
        served = [t for c in chunks for t in c.token_ids]
        _drained(backend)  # the engine is idle: generate runs on this thread
        assert served == backend.engine.generate([prompt], settings).tokens[0]
        assert served == SpeculativeEngine(backend.engine.target).generate([prompt], settings).tokens[0]
        assert chunks[-1].finish_reason == ("stop" if stop(served) else "length")
        reasons.append(chunks[-1].finish_reason)
    assert "stop" in reasons


def test_a_reader_that_falls_behind_gets_the_rounds_in_fewer_chunks(backend):
    """The batcher commits rounds faster than a slow reader takes them: the rounds waiting in the
    request's queue leave as one chunk, with every token (and log-probability) in order."""

    async def run(delay: float):
        chunks = []
        stream = backend.submit(GenRequest(prompt_ids=[4, 5], settings=GenerationConfig(max_new_tokens=24), logprobs=1))
        async for c in stream:
            chunks.append(c)
            await asyncio.sleep(delay)  # the first chunk's pause lets later rounds queue up
        return chunks

    eager, slow = asyncio.run(run(0.0)), asyncio.run(run(0.3))
    ids = [t for c in eager for t in c.token_ids]
    assert [t for c in slow for t in c.token_ids] == ids and len(ids) == 24
    assert len(slow) < slow[-1].spec.verify_ct / 2  # far fewer chunks than rounds
    assert [lp.token_id for c in slow for lp in c.logprobs] == ids
    assert slow[-1].finish_reason == "length" and slow[-1].spec.completion_tokens == 24
