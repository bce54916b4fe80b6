"""The `engine` backend without Ray: streamed chunks carry the request's spec statistics, and a
request whose stream is never read (client gone before the first byte) still frees its slot."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from deploy.serve.backends.base import GenRequest, Overloaded
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
