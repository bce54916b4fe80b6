"""DRelay's draft choice inside vLLM's DFlash proposer, as pure PyTorch (plugin.py wires it in).

vLLM's V1 `DFlashProposer.propose` drafts all H slots of every request in one forward and turns
the slot hidden states into draft ids with `compute_logits(h).argmax`. `DraftChoice` replaces that
argmax with a selector:

    pool     logits = draft_logits(h)            [B·H, V_d]  over the draft vocabulary
             cand_logq, j = top-K of log_softmax(logits)               [B, H, K] each
             cand_ids = target_ids[j]                                  (draft → target ids)
             (the pool our engine builds. vLLM's `compute_logits` scatters the same logits into
             [B·H, V] with −inf outside the draft vocabulary, three times the columns for the
             same log-softmax: plugin.py reads the draft vocabulary's logits where it can, and
             passes `compute_logits` with target_ids None where it cannot)
    context  anchors = next_token_ids [B]; history = each request's last N verified target
             features (a `RequestRings` row), read before this step's drafts
    path     selector.select(DraftBlock(h [B, H, D], cand_ids, cand_logq), ctx).path_ids [B, H]

Verified features. `target_hidden_states` [T, F] (F = L·D, the concatenated target layers) holds
every token the target computed this step, request b's rows at [qsl[b], qsl[b+1]) in batch order;
with vLLM's padded drafter batch the last num_rejected[b] rows are rejected drafts. The valid rows
(the previous anchor and its accepted drafts, or a prefill chunk) are the positions before this
step's anchor: exactly what our engine pushes into `VerifiedHistory` after a round.

Requests, not rows. vLLM's persistent batch moves requests between rows (condense, swap) and rows
are reused, so rings are keyed by request id (`runner.input_batch.req_ids`, batch order): a
request gets a ring row when first seen and gives it back when vLLM forgets it
(`runner.requests`). A ring restarts whenever a request's step does not continue where its ring
ended (`next_pos`): a recomputed prefill after preemption, or a prefix-cache hit (its history then
starts at the first uncached token, which can cost acceptance, never output).

Syncs. The id → row map is host bookkeeping on Python strings; everything on tensors is fixed-shape
gathers, scatters and `torch.where` (no `.item()`, no data-dependent shapes: the gather width is
min(N, max_query_len), a host int vLLM already has).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from deploy.sglang.history import RequestFeatureRing
from drelay_model.drafter import DraftBlock
from drelay_model.selectors import SelectionContext


def valid_rows(hidden: torch.Tensor, qsl: torch.Tensor, rejected: torch.Tensor | None, width: int):
    """The last ≤ `width` verified rows of each request, left-aligned.

    hidden [T, F]; qsl [B+1] request b's rows start at qsl[b]; rejected [B] rejected drafts at the
    end of each request's rows, or None. Returns (feats [B, width, F], n_new [B] int64 ≤ width,
    end [B] int64 one past each request's last valid row)."""
    qsl = qsl.to(torch.long)
    end = qsl[1:] - (rejected.to(torch.long) if rejected is not None else 0)  # [B]
    n_new = (end - qsl[:-1]).clamp(min=0, max=width)  # [B]
    idx = (end - n_new)[:, None] + torch.arange(width, device=hidden.device)  # [B, width]
    return hidden[idx.clamp(0, max(hidden.shape[0] - 1, 0))], n_new, end


class RequestRings:
    """Per-request rings of verified target features, keyed by vLLM request id.

    ring      RequestFeatureRing [R, N, F]: row r = one live request's last N verified features
    next_pos  [R] int64: the position the row's next verified feature must have to continue it
    rows      {request id: ring row}; free rows are those not in it
    """

    def __init__(self, max_requests: int, size: int, dim: int, *, dtype=torch.float32, device="cpu") -> None:
        self.ring = RequestFeatureRing(max_requests, size, dim, dtype=dtype, device=device)
        self.next_pos = torch.full((max_requests,), -1, dtype=torch.long, device=device)  # [R]
        self.rows: dict[str, int] = {}
        self.capacity = max_requests

    def rows_for(self, req_ids: list[str], known) -> torch.Tensor:
        """Ring rows [B] for the batch's request ids (batch order). Rows of requests vLLM no longer
        knows (`known`: a container of live ids) are freed first; a request new to the rings gets a
        free row (when none is free, the row of a request absent from this batch: it restarts
        when it comes back)."""
        for rid in [r for r in self.rows if r not in known]:
            del self.rows[rid]
        batch = set(req_ids)
        fresh = []
        for rid in req_ids:
            if rid not in self.rows:
                taken = set(self.rows.values())
                free = next((r for r in range(self.capacity) if r not in taken), None)
                if free is None:
                    victim = next(r for r in self.rows if r not in batch)
                    free = self.rows.pop(victim)
                self.rows[rid] = free
                fresh.append(free)
        rows = torch.tensor([self.rows[r] for r in req_ids], dtype=torch.long).to(self.ring.buf.device, non_blocking=True)
        if fresh:
            fresh_t = torch.tensor(fresh, dtype=torch.long).to(self.ring.buf.device, non_blocking=True)
            self.ring.count.index_fill_(0, fresh_t, 0)
            self.next_pos.index_fill_(0, fresh_t, -1)
        return rows

    def append_step(self, rows, hidden, qsl, rejected, first_pos, width: int) -> None:
        """Commit one step's verified rows (see `valid_rows`); first_pos [B] is the position of
        each request's first row this step. A row whose step does not continue it restarts."""
        feats, n_new, _ = valid_rows(hidden, qsl, rejected, width)
        cont = self.next_pos[rows] == first_pos  # [B]
        self.ring.count[rows] = torch.where(cont, self.ring.count[rows], torch.zeros_like(n_new))
        self.ring.append(rows, feats, n_new)
        n_valid = (qsl[1:] - qsl[:-1]).to(torch.long) - (rejected.to(torch.long) if rejected is not None else 0)
        self.next_pos[rows] = first_pos + n_valid

    def read(self, rows: torch.Tensor):
        """(feats [B, N, F] right-aligned, mask [B, N]) as our engine's VerifiedHistory holds them."""
        return self.ring.read(rows)


@dataclass
class StagedStep:
    """What `propose` knew before drafting: the batch's ring rows and anchors."""

    rows: torch.Tensor | None  # [B] ring rows, None when the selector reads no history
    anchors: torch.Tensor  # [B] int64 next_token_ids
    anchor_pos: torch.Tensor  # [B] int64
    stage_ms: float = 0.0  # wall ms `stage` took (with a profiler)


class DraftChoice:
    """A selector in place of vLLM's argmax. `stage` once per propose (feeds the rings), then
    `choose` on the slot hidden states."""

    def __init__(self, selector, *, num_slots: int, top_k: int, rings: RequestRings | None) -> None:
        self.selector = selector
        self.num_slots, self.top_k = num_slots, top_k
        self.rings = rings
        self.staged: StagedStep | None = None
        self.recorder = None  # callable(dict of tensors) for the replay check, or None
        self.profiler = None  # callable(dict of wall ms per part) for the plugin's profile, or None

    def stage(self, req_ids, known, *, hidden, qsl, rejected, positions, anchors, max_query_len: int) -> None:
        """Before drafting: feed each request's verified features into its ring and remember
        the anchors. hidden [T, F] raw target features; qsl [B+1]; rejected [B] or None;
        positions [T] (row 0 when M-RoPE gives [3, T]); anchors [B]."""
        clock = _Clock(hidden) if self.profiler is not None else None
        pos = positions[0] if positions.ndim == 2 else positions
        qsl_l = qsl.to(torch.long)
        last = (qsl_l[1:] - 1 - (rejected.to(torch.long) if rejected is not None else 0)).clamp(min=0)
        anchor_pos = pos[last].to(torch.long) + 1  # [B]
        rows = None
        if self.rings is not None:
            rows = self.rings.rows_for(list(req_ids), known)
            first_pos = pos[qsl_l[:-1].clamp(max=pos.shape[0] - 1)].to(torch.long)
            width = max(1, min(self.rings.ring.size, int(max_query_len)))
            self.rings.append_step(rows, hidden, qsl, rejected, first_pos, width)
        self.staged = StagedStep(rows=rows, anchors=anchors.to(torch.long), anchor_pos=anchor_pos,
                                 stage_ms=clock.lap() if clock else 0.0)  # fmt: skip

    @torch.inference_mode()
    def choose(self, logits_fn, hidden: torch.Tensor, target_ids: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [B·H, D] slot hidden states (slots 1..H of each request, request-major) →
        draft ids [B·H] int64 (target vocabulary). `logits_fn(hidden)` gives [B·H, V'] logits: over
        the target vocabulary when target_ids is None, else over the draft vocabulary, whose column j
        is target id target_ids[j] ([V'] int64). With a profiler, each step's parts are timed (wall
        ms; on a GPU after a synchronize): stage (the rings' update), logits (the drafter's LM head,
        which vLLM's native argmax needs too), pool (log-softmax, top-K, the id map), history (the
        rings' read) and select."""
        step, self.staged = self.staged, None
        B, H, K = step.anchors.shape[0], self.num_slots, self.top_k
        clock = _Clock(hidden) if self.profiler is not None else None
        logits = logits_fn(hidden)  # [B·H, V']
        logits_ms = clock.lap() if clock else 0.0
        logq = torch.log_softmax(logits.float(), dim=-1)
        cand_logq, cand_ids = logq.topk(K, dim=-1)  # [B·H, K]: columns of `logits`
        if target_ids is not None:
            cand_ids = target_ids[cand_ids]
        block = DraftBlock(
            hidden=hidden.view(B, H, -1).to(self._dtype()),
            cand_ids=cand_ids.view(B, H, K),
            cand_logq=cand_logq.view(B, H, K),
        )
        pool_ms = clock.lap() if clock else 0.0
        history, mask = self.rings.read(step.rows) if step.rows is not None else (None, None)
        history_ms = clock.lap() if clock else 0.0
        ctx = SelectionContext(
            anchor_ids=step.anchors,
            anchor_pos=step.anchor_pos,
            # ring rows name requests wherever vLLM moves them: the fast path's history cache follows them
            row_ids=step.rows if step.rows is not None else torch.arange(B, device=hidden.device),
            history=history,
            history_mask=mask,
        )
        path = self.selector.select(block, ctx).path_ids  # [B, H]
        if clock:
            self.profiler({"batch": B, "stage_ms": step.stage_ms, "logits_ms": logits_ms, "pool_ms": pool_ms,
                           "history_ms": history_ms, "select_ms": clock.lap()})  # fmt: skip
        if self.recorder is not None:
            self.recorder({"hidden": block.hidden, "cand_ids": block.cand_ids, "cand_logq": block.cand_logq,
                           "anchors": step.anchors, "anchor_pos": step.anchor_pos, "row_ids": ctx.row_ids,
                           "history": history, "history_mask": mask, "path": path})  # fmt: skip
        return path.reshape(-1)

    def _dtype(self) -> torch.dtype:
        return next((p.dtype for p in self.selector.parameters()), torch.float32)


class _Clock:
    """Wall-clock laps for the profiler; on a GPU each lap first waits for the device's queued work."""

    def __init__(self, like: torch.Tensor) -> None:
        self.cuda = like.is_cuda
        if self.cuda:
            torch.cuda.synchronize()
        self.t = time.perf_counter()

    def lap(self) -> float:
        """ms since the last lap (or the start)."""
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        ms, self.t = (now - self.t) * 1e3, now
        return ms
