"""Continuous batching: requests join and leave the engine's batch between rounds.

    submit(prompt, settings)    queue a request (thread-safe); it joins at the next `step`
    step():  admit   prefill queued requests into caches of their own (`SpeculativeEngine.prefill`,
                     a forward per length group: `prefill_groups`), at most `prefill_budget` prompt
                     tokens per step, first in first out, a prompt longer than the budget in chunks
                     over several steps (`admission.py`); pick each first token, and
                     merge their rows into the running batch
                     (`BatchState.merge`; KV capacity grows to the largest need and shrinks again
                     when long requests leave, `BatchState.set_capacity`)
             round   one engine round (`SpeculativeEngine.round`: plan → draft → select → verify →
                     commit) over every running row, with each row's own acceptance rule
                     (`sampling.accept_rows`) and, at T > 0 with `draft_sampling`, a path drawn at
                     the row's temperature from its own proposal numbers (`sampling.path_sampler`)
             commit  per row: append tokens up to EOS / the stop predicate / the budget, update the
                     request's statistics, call its `on_update` with the newly committed ids
             leave   drop finished and cancelled rows from every per-row state

Every row's computation is independent of the other rows (per-row cache lengths and masks), so a
request's greedy output is the one it gets decoded alone, whoever shares the batch. This is the one
decoding loop: `SpeculativeEngine.generate` submits a static batch here (all admitted by the first
step, prefilled by length groups) and runs it to completion, so evaluation, the CLI and the endpoint decode alike.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import torch

from drelay_model.decoding.admission import ChunkedPrefill, check_budget, plan_admission
from drelay_model.decoding.batch_state import BatchState
from drelay_model.decoding.generation import GenerationConfig
from drelay_model.decoding.logprobs import TokenLogprob, first_token_logprobs
from drelay_model.decoding.prefill_groups import prefill_groups
from drelay_model.decoding.draws import RowDraws, commit_rows
from drelay_model.decoding.sampling import accept_rows, path_sampler, pick_row
from drelay_model.decoding.stats import DecodeStats, RequestStats
from drelay_model.errors import DRelayError


class RoundEngine(Protocol):
    """What the batcher drives (`SpeculativeEngine`, engine.py, which in turn runs its `generate` on
    a batcher: the batcher names the interface, not the class, so neither module imports the other's)."""

    device: torch.device
    target: Any
    drafter: Any
    num_slots: int
    policy: Any
    threads: Any  # a ThreadPolicy (kernels/threads.py) or None: consulted once per step

    def check_prompt(self, prompt: list[int], config: GenerationConfig, what: str = "prompt") -> int: ...
    def prefill(self, prompts: list[list[int]], rows: list[int], capacity: int,
                into: BatchState | None = None) -> tuple[BatchState, torch.Tensor]: ...  # fmt: skip
    def round(self, state: BatchState, accept_rule, stats: DecodeStats, policy=None, sampler=None, logprobs=None): ...
    def new_policy(self): ...


@dataclass(frozen=True)
class RequestUpdate:
    """What one step produced for one request: `new_tokens` just committed (may be empty when it
    finished without a new token, e.g. cancelled); finish_reason 'stop' | 'length' | 'cancelled';
    logprobs: one entry per new token when the request asked (`submit(logprobs=k)`), else None."""

    request_id: int
    new_tokens: list[int]
    finished: bool
    finish_reason: str | None
    stats: RequestStats
    logprobs: list[TokenLogprob] | None = None


UpdateCallback = Callable[[RequestUpdate], None]


@dataclass
class _Request:
    id: int
    prompt: list[int]
    settings: GenerationConfig
    on_update: UpdateCallback | None
    stats: RequestStats
    need: int  # KV positions this request may use: prompt + budget + one block + 2
    draws: RowDraws | None = None  # sampling numbers (T > 0)
    logprobs: int | None = None  # alternatives per token when the request asked for log-probabilities
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    t_submit: float = field(default_factory=time.perf_counter)
    t_prefill: tuple[float, float] | None = None  # its first prefill forward's start, its last one's end


class ContinuousBatcher:
    """Runs an engine over a changing set of requests; `step` is called by one driving thread."""

    def __init__(
        self, engine: RoundEngine, *, max_batch: int = 16, engine_policy: bool = False, prefill_budget: int | None = None
    ) -> None:
        """engine_policy: the rounds consult the engine's cost policy (`SpeculativeEngine.policy`, read
        at each round; what it learns carries over the engine's calls) instead of a fresh one of
        this batcher's own (`engine.new_policy()`; None without measured costs). prefill_budget:
        prompt tokens prefilled per step (`admission.py`; None: every queued request with room,
        whole, as a static batch)."""
        if max_batch < 1:
            raise DRelayError(f"max_batch must be ≥ 1, got {max_batch}")
        self.engine = engine
        self.max_batch = max_batch
        self.prefill_budget = check_budget(prefill_budget)
        self._chunked: ChunkedPrefill | None = None  # the request whose prompt is prefilled in chunks
        self.stats = DecodeStats(num_slots=engine.num_slots)  # batch-level phase times and totals
        self._policy = None if engine_policy else engine.new_policy()
        self._engine_policy = engine_policy
        self._lock = threading.Lock()
        self._pending: list[_Request] = []
        self._cancelled: set[int] = set()
        self._running: dict[int, _Request] = {}
        self._state: BatchState | None = None
        self._next_id = 0

    # ---- public --------------------------------------------------------------------------------
    def submit(
        self,
        prompt: list[int],
        settings: GenerationConfig = GenerationConfig(),
        on_update: UpdateCallback | None = None,
        *,
        logprobs: int | None = None,
        what: str = "prompt",
    ) -> int:
        """Queue a request; returns its id. Raises DRelayError for a prompt the target cannot take
        (the message names it `what`). logprobs = k ≥ 0: each update carries its tokens'
        log-probabilities and k alternatives."""
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
            raise DRelayError(f"logprobs must be an integer ≥ 0 or None, got {logprobs!r}")
        need = self.engine.check_prompt(prompt, settings, what=what)
        stats = RequestStats(num_slots=self.engine.num_slots, prompt_tokens=len(prompt))
        draws = None if settings.greedy else RowDraws(settings.seed, self.engine.device)
        with self._lock:
            rid = self._next_id
            self._next_id += 1
            self._pending.append(_Request(rid, list(prompt), settings, on_update, stats, need, draws, logprobs))
        return rid

    def cancel(self, request_id: int) -> None:
        """Finish a request at the next step (thread-safe; unknown or finished ids are ignored)."""
        with self._lock:
            self._cancelled.add(request_id)

    @property
    def policy(self):
        """The cost-aware verification length's policy the rounds consult (cost_policy/), or None."""
        return self.engine.policy if self._engine_policy else self._policy

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_pending(self) -> int:
        """Requests not decoding yet: queued, or with their prompt partly prefilled."""
        with self._lock:
            return len(self._pending) + (self._chunked is not None)

    @property
    def idle(self) -> bool:
        return not self._running and self.num_pending == 0

    @torch.inference_mode()
    def step(self) -> list[RequestUpdate]:
        """Admit queued requests (up to max_batch running, within the prefill budget), then run one
        round over all rows."""
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
            dropped = [r for r in self._pending if r.id in cancelled]
            self._pending = [r for r in self._pending if r.id not in cancelled]
        updates = [self._finish(r, [], "cancelled") for r in dropped]
        if self._chunked is not None and self._chunked.request.id in cancelled:
            updates.append(self._finish(self._chunked.request, [], "cancelled"))
            self._chunked = None
        updates += [self._finish(self._running[i], [], "cancelled") for i in cancelled if i in self._running]
        with self._lock:
            chunked = self._chunked
            room = self.max_batch - len(self._running) - (chunked is not None)
            plan = plan_admission(chunked and chunked.remaining, [len(r.prompt) for r in self._pending], room,
                                  self.prefill_budget)  # fmt: skip
            admit, self._pending = self._pending[: plan.whole], self._pending[plan.whole :]
            if plan.start_tokens:
                self._chunked = ChunkedPrefill(self._pending.pop(0))
        rows = len(admit) + len(self._running) + (self._chunked is not None)
        if self.engine.threads is not None and rows:
            self.engine.threads.update(rows=rows)  # in the rounds' thread (OpenMP: per thread)
        if plan.continue_tokens:
            updates += self._prefill_chunk(chunked, plan.continue_tokens)
        if admit:
            updates += self._admit(admit)
        if plan.start_tokens:
            updates += self._prefill_chunk(self._chunked, plan.start_tokens)
        self._leave()  # cancelled rows, and requests that finished on their prefill token
        if self._running:
            updates += self._round()
            self._leave(reuse=True)
        return updates

    def run(self) -> dict[int, list[int]]:
        """Step until nothing is queued or running; returns every finished request's tokens."""
        out: dict[int, list[int]] = {}
        while not self.idle:
            for u in self.step():
                out.setdefault(u.request_id, []).extend(u.new_tokens)
        return out

    # ---- phases --------------------------------------------------------------------------------
    def _admit(self, requests: list[_Request]) -> list[RequestUpdate]:
        """Prefill new requests, a forward per length group (`prefill_groups`: little padding), and
        join their rows to the running batch."""
        groups = prefill_groups([len(r.prompt) for r in requests])
        return [u for g in groups for u in self._admit_group([requests[i] for i in g])]

    def _admit_group(self, requests: list[_Request]) -> list[RequestUpdate]:
        t0 = time.perf_counter()
        capacity = max(r.need for r in requests)
        state, last_logits = self.engine.prefill([r.prompt for r in requests], [r.id for r in requests], capacity)
        self._count_prefill(t0)
        for r in requests:
            r.t_prefill = (t0, time.perf_counter())
        return self._join(requests, state, last_logits)

    def _prefill_chunk(self, chunked: ChunkedPrefill, n: int) -> list[RequestUpdate]:
        """The next `n` tokens of a chunked request's prompt into its row's caches; when they are its
        last, its row joins the batch."""
        r, t0 = chunked.request, time.perf_counter()
        ids = r.prompt[chunked.done : chunked.done + n]
        chunked.state, last_logits = self.engine.prefill([ids], [r.id], r.need, into=chunked.state)
        chunked.done += n
        self._count_prefill(t0)
        r.t_prefill = (r.t_prefill[0] if r.t_prefill else t0, time.perf_counter())
        if chunked.remaining:
            return []
        if self._chunked is chunked:  # the next chunked request may already have started this step
            self._chunked = None
        return self._join([r], chunked.state, last_logits)

    def _count_prefill(self, t0: float) -> None:
        elapsed = time.perf_counter() - t0
        self.stats.time_prefill += elapsed
        self.stats.time_total += elapsed

    def _join(self, requests: list[_Request], state: BatchState, last_logits: torch.Tensor) -> list[RequestUpdate]:
        """Pick the first token of freshly prefilled rows (`last_logits` [B, V]) and join them to the
        running batch."""
        t0 = time.perf_counter()
        if all(r.settings.greedy for r in requests):
            state.anchor = last_logits.argmax(dim=-1)  # [B]
        else:
            state.anchor = torch.cat([pick_row(last_logits[i : i + 1], r.settings, r.draws) for i, r in enumerate(requests)])
        commit_rows([r.draws for r in requests], [1] * len(requests))
        lps = first_token_logprobs(last_logits, state.anchor, [r.logprobs for r in requests])
        self.stats.time_total += time.perf_counter() - t0
        self.stats.generated += len(requests)
        self.stats.requests += len(requests)
        if self._state is None:
            self._state = state
        elif len(requests) <= len(free := self._free_slots()):  # into the slots of rows that finished last round
            self._state.fill(free[: len(requests)], state)
        else:
            self._state = self._state.merge(state)  # pending features stay pending
        updates = []
        for r, tok, lp in zip(requests, state.anchor.tolist(), lps):
            self._running[r.id] = r
            self._first_token_times(r)
            updates.append(self._commit(r, [tok], lp))
        return updates

    @staticmethod
    def _first_token_times(r: _Request) -> None:
        """TTFT and its parts (`RequestStats`), from the request's marks; they sum to the TTFT."""
        now, (start, end) = time.perf_counter(), r.t_prefill
        s = r.stats
        s.time_to_first_token = now - r.t_submit
        s.time_queue, s.time_prefill, s.time_first_round = start - r.t_submit, end - start, now - end

    def _round(self) -> list[RequestUpdate]:
        state = self._state
        reqs = [self._running[i] for i in state.rows]
        accept_rule = partial(accept_rows, settings=[r.settings for r in reqs], draws=[r.draws for r in reqs])
        t0 = time.perf_counter()
        sampler = path_sampler([r.settings for r in reqs], [r.draws for r in reqs], self.engine.device)
        result = self.engine.round(state, accept_rule, self.stats, self.policy, sampler, logprobs=[r.logprobs for r in reqs])
        n_list, x_list, p_list = result.accepted.tolist(), result.next_token.tolist(), result.path.tolist()  # one host copy
        v_list = result.length.tolist() if result.drafted else None
        updates, committed = [], []
        for i, r in enumerate(reqs):
            before = len(r.tokens)
            update = self._commit(r, p_list[i][: n_list[i]] + [x_list[i]], result.logprobs and result.logprobs[i])
            committed.append(len(r.tokens) - before)
            r.stats.record_round(n_list[i], committed[-1], None if v_list is None else v_list[i])
            updates.append(update)
        self.stats.record_round(n_list, committed, v_list)
        self.stats.steps += 1
        self.stats.generated += sum(committed)
        self.stats.time_total += time.perf_counter() - t0
        return updates

    def _leave(self, reuse: bool = False) -> None:
        """Drop finished rows; shrink the caches when the longest remaining need is under half.

        With `reuse` (after a round), finished rows stay in the state as free slots until the next
        step: requests that arrive meanwhile are written into them (`BatchState.fill`) instead of
        every cache being compacted now and grown again then (`merge`); that step's `_leave` drops
        whatever it left free, before any round runs."""
        for rid in [i for i, r in self._running.items() if r.finish_reason is not None]:
            del self._running[rid]
        state = self._state
        if state is None:
            return
        if not self._running:
            self._state = None
            return
        if reuse and len(self._running) < len(state.rows):
            return  # the finished rows' slots stay, free (`_free_slots`)
        state.keep([i for i in state.rows if i in self._running])
        need = max(self._running[i].need for i in state.rows)
        if 2 * need < state.cache.capacity:
            state.set_capacity(need)

    def _free_slots(self) -> list[int]:
        """Positions in the batch state of rows whose requests have left (kept after a round by
        `_leave(reuse=True)` for the next admission to fill)."""
        return [p for p, i in enumerate(self._state.rows) if i not in self._running]

    # ---- host-side bookkeeping -----------------------------------------------------------------
    def _commit(self, r: _Request, new_tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> RequestUpdate:
        """Append tokens until EOS, the stop predicate or the budget ends the request; `logprobs`
        (one per new token, when the request asked) are cut to the tokens kept."""
        p, eos = r.settings, self.engine.target.eos_token_ids
        added, reason = [], None
        for t in new_tokens:
            r.tokens.append(t)
            added.append(t)
            if len(r.tokens) >= p.max_new_tokens:
                reason = "length"
            if (p.stop_on_eos and t in eos) or (p.stop is not None and p.stop(r.tokens)):
                reason = "stop"
            if reason:
                break
        r.stats.generated = len(r.tokens)
        kept = None if logprobs is None else logprobs[: len(added)]
        if reason:
            return self._finish(r, added, reason, kept)
        return self._notify(r, RequestUpdate(r.id, added, False, None, r.stats, kept))

    def _finish(self, r: _Request, added: list[int], reason: str, logprobs: list[TokenLogprob] | None = None) -> RequestUpdate:
        r.finish_reason = reason
        r.stats.time_total = time.perf_counter() - r.t_submit
        if logprobs is None and r.logprobs is not None:
            logprobs = []  # a request that asked always gets a list, one entry per new token
        return self._notify(r, RequestUpdate(r.id, added, True, reason, r.stats, logprobs))

    @staticmethod
    def _notify(r: _Request, update: RequestUpdate) -> RequestUpdate:
        if r.on_update is not None:
            r.on_update(update)
        return update
