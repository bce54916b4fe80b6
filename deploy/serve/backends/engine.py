"""`engine` backend: this project's engine with continuous batching, any registered selector, CPU or GPU.

One daemon thread drives `ContinuousBatcher.step()` while requests are queued or running; request
coroutines submit to the batcher and read their committed ids from an asyncio queue that the
batcher's per-round callback feeds (`loop.call_soon_threadsafe`). A client that goes away cancels
its request, so its row leaves the batch at the next round.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path

from deploy.serve.backends.base import Backend, GenChunk, GenRequest, Overloaded, SpecStats
from deploy.serve.config import EngineSection, LimitsSection
from drelay_model.decoding.batcher import ContinuousBatcher, RequestUpdate
from drelay_model.errors import DRelayError
from drelay_model.kernels.threads import ThreadPolicy
from drelay_model.target import SMOLLM2, load_target
from pipelines.common.engines import build_engine
from pipelines.common.methods import resolve_method

log = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parents[3]


def _repo_path(path: str | None) -> str | None:
    """Config paths are relative to the repository root (replicas may run in another directory);
    registry references (`models:/<name>@<alias>`) pass through to `resolve_method`."""
    if path is None or path.startswith("models:/") or Path(path).is_absolute() or Path(path).exists():
        return path
    return str(REPO_ROOT / path)


def load_tokenizer(spec: str):
    """A tokenizer by spec: 'smollm2-135m' (the bundled CPU default) or a Hugging Face directory."""
    from transformers import AutoTokenizer

    if spec == SMOLLM2:
        from drelay_model.target.loading import _smollm2_dir  # converts the bundled GGUF once

        spec = str(_smollm2_dir())
    try:
        return AutoTokenizer.from_pretrained(spec)
    except (OSError, ValueError) as exc:
        raise DRelayError(f"engine.tokenizer: cannot load '{spec}': {str(exc).splitlines()[0]}") from None


def _deliver(loop: asyncio.AbstractEventLoop, callback, *args) -> bool:
    """Schedule `callback(*args)` on a request's event loop from the batcher thread; False when that
    loop has closed (the app is shutting down, or the caller's `asyncio.run` ended): the update has no
    reader, and raising here would end the batcher thread with an unhandled exception."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # "Event loop is closed" (checking is_closed() first would race the close)
        return False
    return True


class EngineBackend(Backend):
    def __init__(self, cfg: EngineSection, limits: LimitsSection) -> None:
        target = load_target(cfg.target, device=cfg.device, dtype=cfg.dtype)  # a one-line error without CUDA
        spec = resolve_method(
            cfg.method, target_spec=cfg.target, checkpoint=_repo_path(cfg.checkpoint), random_drafter=cfg.random_drafter
        )
        self.method = cfg.method
        self.engine = build_engine(target, spec, cfg.verify_length, target_spec=cfg.target, max_batch=cfg.max_batch,
                                   threads=ThreadPolicy.parse(cfg.threads))  # fmt: skip
        self.batcher = ContinuousBatcher(self.engine, max_batch=cfg.max_batch, prefill_budget=cfg.prefill_budget)
        self.tokenizer = load_tokenizer(cfg.tokenizer) if cfg.tokenizer else target.tokenizer
        if self.tokenizer is None:
            raise DRelayError(f"engine.tokenizer: target '{cfg.target}' has no tokenizer; name one")
        self.context_window = target.max_positions
        self.max_waiting = limits.max_waiting
        self._queues: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._batch_sizes: deque[int] = deque(maxlen=65536)  # per step, until `drain_batch_sizes`
        self._stopping = False
        self._thread = threading.Thread(target=self._drive, name="drelay-batcher", daemon=True)
        self._thread.start()

    # ---- the driving thread --------------------------------------------------------------------
    def _drive(self) -> None:
        while not self._stopping:
            if self.batcher.idle:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                rounds = self.batcher.stats.rounds
                self.batcher.step()
                if self.batcher.stats.rounds > rounds:  # row-rounds this step = its batch size
                    self._batch_sizes.append(self.batcher.stats.rounds - rounds)
            except Exception as exc:  # an engine failure fails the requests in flight, not the replica
                log.exception("engine step failed")
                self._fail_all(exc)

    def _fail_all(self, exc: Exception) -> None:
        for loop, queue in list(self._queues.values()):
            _deliver(loop, queue.put_nowait, exc)
        self._queues.clear()
        old = self.batcher
        self.batcher = ContinuousBatcher(self.engine, max_batch=old.max_batch, prefill_budget=old.prefill_budget)

    # ---- the interface -------------------------------------------------------------------------
    def load(self) -> dict[str, int]:
        return {"running": self.batcher.num_running, "waiting": self.batcher.num_pending}

    def drain_batch_sizes(self) -> list[int]:
        sizes = []
        try:
            while True:  # popleft is atomic: the driving thread may append, another reader drain, meanwhile
                sizes.append(self._batch_sizes.popleft())
        except IndexError:
            return sizes

    def threads(self) -> dict:
        policy = self.engine.threads
        return {"torch_threads": policy.current, "threads": policy.describe_setting()}

    def ready(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def submit(self, request: GenRequest) -> AsyncIterator[GenChunk]:
        """Validate and queue now (raising DRelayError / Overloaded before any response is sent);
        the returned iterator streams the request's chunks."""
        in_flight = len(self._queues)  # submitted and not finished (the driver may not have admitted them yet)
        if in_flight >= self.batcher.max_batch + self.max_waiting:
            raise Overloaded(
                f"replica saturated: {in_flight} requests in flight "
                f"(max_batch {self.batcher.max_batch} + max_waiting {self.max_waiting})"
            )
        loop, queue, rid_box = asyncio.get_running_loop(), asyncio.Queue(), []

        def on_update(update: RequestUpdate) -> None:
            if not _deliver(loop, queue.put_nowait, update):  # the caller's loop is gone (shutdown)
                self._queues.pop(rid_box[0], None)
                if not update.finished:
                    self.batcher.cancel(rid_box[0])
                return
            if update.finished:  # free the slot even if no one ever reads the stream (client gone early)
                _deliver(loop, self._queues.pop, rid_box[0], None)

        rid = self.batcher.submit(request.prompt_ids, request.settings, on_update, logprobs=request.logprobs)
        rid_box.append(rid)  # set before the loop runs any callback scheduled above
        self._queues[rid] = (loop, queue)
        self._wake.set()
        return self._stream(rid, queue)

    async def _stream(self, rid: int, queue: asyncio.Queue) -> AsyncIterator[GenChunk]:
        finished = False
        try:
            while not finished:
                update = await queue.get()
                if isinstance(update, Exception):
                    raise update
                ids = list(update.new_tokens)
                lps = None if update.logprobs is None else list(update.logprobs)
                # Rounds the reader fell behind on leave as one chunk: one SSE event and one hop
                # through Ray Serve's stream instead of one per round (docs/serving.md).
                while not update.finished and not queue.empty():
                    later = queue.get_nowait()
                    if isinstance(later, Exception):
                        raise later
                    ids += later.new_tokens
                    if lps is not None:
                        lps += later.logprobs or []
                    update = later
                finished = update.finished
                spec = None
                if finished:
                    s = update.stats
                    spec = SpecStats(verify_ct=s.rounds, accept_histogram=list(s.accept_hist), completion_tokens=s.generated,
                                     drafted_ct=s.drafted_rounds, verified_drafts=s.verified_drafts,
                                     ttft_parts=(s.time_queue, s.time_prefill, s.time_first_round))  # fmt: skip
                reason = update.finish_reason if finished else None
                yield GenChunk(token_ids=ids, finish_reason=reason, spec=spec, logprobs=lps)
        finally:
            self._queues.pop(rid, None)
            if not finished:
                self.batcher.cancel(rid)  # the client went away: free the row

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=5)
