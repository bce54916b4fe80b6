"""Feeding the verified-feature ring (history.py) from SGLang's forwards, as the DFLASH worker
delivers their target features to `_append_target_hidden_to_draft_kv_by_loc`.

Two shapes arrive (SGLang 0.5.23, `DFlashWorkerV2.forward_batch_generation`):
  - prefill / extend: features of every new token, packed row after row, `[sum(extend_lens) (+
    padding), L·D]`, with `extend_lens` and `prefix_lens` known on the host (`ScheduleBatch`);
  - verify: dense blocks `[bs·S, L·D]` with `commit_lens [bs]` on the device (tokens each row accepted).

Prefill: only the last N features of a chunk can ever be read, so the host builds the index of those
rows (≤ N per request) from `extend_lens` and gathers exactly them: no `[bs, longest prompt, L·D]`
tensor and no device→host sync. A chunked prefill reaches the worker as several extends of one
request; a continuation chunk (same request id in the slot, `prefix_len` = where the last chunk
ended, no decode in between) appends to the ring, anything else (a new request in a reused slot, a
radix-cache hit, a retracted request prefilled again) starts it afresh (`PrefillTracker`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deploy.sglang.history import RequestFeatureRing


def _h2d(values: Sequence[int], device) -> torch.Tensor:
    """Host ints → int64 tensor on `device` (pinned and non-blocking on CUDA: no stream sync)."""
    t = torch.tensor(list(values), dtype=torch.long)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass(frozen=True)
class PrefillFeed:
    """Which packed rows a prefill commits to the ring, built on the host.

    lens     [bs]  int64  tokens each request's chunk adds (its `extend_len`)
    fresh    [R]   int64  batch rows whose ring starts afresh (R ≤ bs)
    rows     [M]   int64  batch row of each kept token (M ≤ bs·N: each chunk's last N tokens)
    offsets  [M]   int64  the token's index within its chunk
    tokens   [M]   int64  the token's row in the packed features
    """

    lens: torch.Tensor
    fresh: torch.Tensor
    rows: torch.Tensor
    offsets: torch.Tensor
    tokens: torch.Tensor


def plan_prefill(extend_lens: Sequence[int], fresh: Sequence[bool], *, size: int, device="cpu") -> PrefillFeed:
    """The feed of one packed prefill: chunk b has extend_lens[b] tokens at packed rows
    [start_b, start_b + extend_lens[b]); its last min(extend_lens[b], size) are kept."""
    rows: list[int] = []
    offsets: list[int] = []
    tokens: list[int] = []
    start = 0
    for b, n in enumerate(extend_lens):
        first = max(0, n - size)
        rows += [b] * (n - first)
        offsets += range(first, n)
        tokens += range(start + first, start + n)
        start += n
    return PrefillFeed(
        lens=_h2d(extend_lens, device),
        fresh=_h2d([b for b, f in enumerate(fresh) if f], device),
        rows=_h2d(rows, device),
        offsets=_h2d(offsets, device),
        tokens=_h2d(tokens, device),
    )


def feed_prefill(ring: RequestFeatureRing, slots: torch.Tensor, target_hidden: torch.Tensor, feed: PrefillFeed) -> None:
    """Commit a packed prefill's features [T, L·D] to the rings of request-pool `slots` [bs]."""
    ring.reset(slots[feed.fresh])
    ring.append_packed(slots, feed.lens, feed.rows, feed.offsets, target_hidden[feed.tokens])


def feed_verify(ring: RequestFeatureRing, slots: torch.Tensor, target_hidden: torch.Tensor, commit_lens: torch.Tensor) -> None:
    """Commit a verify forward: dense blocks [bs·S, L·D], the first commit_lens[b] of row b accepted."""
    bs = slots.shape[0]
    S = target_hidden.shape[0] // bs
    ring.append(slots, target_hidden[: bs * S].view(bs, S, target_hidden.shape[-1]), commit_lens.to(torch.long))


class PrefillTracker:
    """Host-side record of where each request-pool slot's last prefill chunk ended, to tell a
    chunked prefill's continuation (append) from a fresh start (reset)."""

    def __init__(self) -> None:
        self._fed: dict[int, tuple[str, int]] = {}  # slot → (request id, tokens fed through the last chunk)

    def fresh_rows(
        self, slots: Sequence[int], rids: Sequence[str], prefix_lens: Sequence[int], extend_lens: Sequence[int]
    ) -> list[bool]:
        """For an extend batch: True where the ring must start afresh; records the chunks."""
        fresh = []
        for slot, rid, prefix, n in zip(slots, rids, prefix_lens, extend_lens):
            fresh.append(prefix == 0 or self._fed.get(slot) != (rid, prefix))
            self._fed[slot] = (rid, prefix + n)
        return fresh

    def decoded(self, slots: Sequence[int]) -> None:
        """These slots ran a decode round: a later extend of theirs is never a continuation."""
        for slot in slots:
            self._fed.pop(slot, None)
