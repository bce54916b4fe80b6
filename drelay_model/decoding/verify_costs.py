"""The measured cost curve of one round, for cost-aware verification length (`length_bandit.py`).

A round that drafts h slots, decides d of them and verifies L costs

    t(h, d, L) = draft(h) + select + (d − 1)·select_slot + extend + verify(1 + L)     (h > 0, d > 0)
    t(h, 0, L) = draft(h) + extend + verify(1 + L)              (the native path, no selector call)
    t(0, 0, 0) = verify(1)                                                           (an AR round)

draft(h) is the drafter over a block of the anchor and h masked positions, with an LM head on each
(`BlockDrafter.draft(slots=h)`); a selector that reads the whole pool always pays draft(H). Files
written before draft(h) was measured model it as block + h·head over the whole block.

`measure_costs` times every term once per machine, target and drafter (cached as JSON by
`pipelines.common.costs`). On a shared machine single timings swing by ±30%, so it interleaves all
terms in each repetition (drift then shifts every term alike), takes the median per term, and fits
verify(t) non-decreasing by isotonic regression (a running maximum would let one slow first call
flatten the whole curve). The policy rescales the curve online from the rounds it times.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from drelay_model.errors import DRelayError


# What `measure_costs` measures, versioned: 2 = draft(h) per length, 3 = a partial-block
# selector's select_ms on a one-slot block. A cached file of an older version is measured again.
COSTS_VERSION = 3


@dataclass(frozen=True)
class VerifyCosts:
    """Measured costs in milliseconds (batch of one row).

    verify_ms  [H + 1] target forward over t = 1 .. H + 1 new tokens on a cached context
    block_ms   drafter layers over one whole block (everything but the LM head)
    head_ms    LM head + top-K for one slot
    draft_slots_ms  [H] the drafter over a block of h = 1 .. H slots, heads included (empty in files
               written before it existed: then block_ms + h·head_ms)
    select_ms  the selector deciding one slot (`SelectionContext.max_slots` = 1) on a whole block, or on
               a one-slot block for a partial-block selector
    select_slot_ms  each further decided slot (0 for a selector whose cost does not depend on it;
               files written before it existed hold the whole block's cost in select_ms)
    extend_ms  extending the drafter's context by a drafted round's verified positions (0 in files
               written before it existed)
    """

    verify_ms: tuple[float, ...]
    block_ms: float
    head_ms: float
    select_ms: float
    select_slot_ms: float = 0.0
    extend_ms: float = 0.0
    draft_slots_ms: tuple[float, ...] = ()
    version: int = COSTS_VERSION  # of the measurement (files written before versions existed: 1)

    def __post_init__(self) -> None:
        if not self.verify_ms or any(not (t > 0 and math.isfinite(t)) for t in self.verify_ms):
            raise DRelayError(f"verify_ms must be positive and finite, got {self.verify_ms}")
        others = (self.block_ms, self.head_ms, self.select_ms, self.select_slot_ms, self.extend_ms)
        if any(not (t >= 0 and math.isfinite(t)) for t in others):
            raise DRelayError("block_ms, head_ms, select_ms, select_slot_ms and extend_ms must be finite and ≥ 0")
        if any(not (t > 0 and math.isfinite(t)) for t in self.draft_slots_ms) or len(self.draft_slots_ms) > self.max_slots:
            raise DRelayError(
                f"draft_slots_ms must hold at most {self.max_slots} positive finite times, got {self.draft_slots_ms}"
            )

    @property
    def max_slots(self) -> int:
        return len(self.verify_ms) - 1

    def draft_ms(self, head_slots: int, decided: int | None = None) -> float:
        """Drafting `head_slots` slots, selecting `decided` of them (default: all of them; 0: the
        native path, no selector call) and extending the drafter's context afterwards; 0 with no
        drafting."""
        if head_slots == 0:
            return 0.0
        decided = head_slots if decided is None else decided
        select = self.select_ms + (decided - 1) * self.select_slot_ms if decided > 0 else 0.0  # 0: no selector ran
        if head_slots <= len(self.draft_slots_ms):
            drafting = self.draft_slots_ms[head_slots - 1]
        else:  # an older file: the whole block, heads on head_slots of it
            drafting = self.block_ms + head_slots * self.head_ms
        return drafting + select + self.extend_ms

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> "VerifyCosts":
        try:
            raw = json.loads(Path(path).read_text())
            return cls(verify_ms=tuple(float(t) for t in raw["verify_ms"]), block_ms=float(raw["block_ms"]),
                       head_ms=float(raw["head_ms"]), select_ms=float(raw["select_ms"]),
                       select_slot_ms=float(raw.get("select_slot_ms", 0.0)),
                       extend_ms=float(raw.get("extend_ms", 0.0)),
                       draft_slots_ms=tuple(float(t) for t in raw.get("draft_slots_ms", ())),
                       version=int(raw.get("version", 1)))  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DRelayError(f"cannot read verification costs from {path}: {exc}") from exc


def isotonic(values: list[float]) -> list[float]:
    """The non-decreasing sequence nearest to `values` in least squares (pool adjacent violators):
    a block of out-of-order values becomes their mean, so one outlier moves its neighbours a little
    instead of raising everything after it."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, n2), (m1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(n)]


@torch.inference_mode()
def measure_costs(target, drafter, selector, *, context_len: int = 200, reps: int = 9, extend_tokens: int = 4) -> VerifyCosts:
    """Time one row's verify(1 .. H + 1), drafting of 1 .. H slots, the LM head per slot, selection
    and context extension (by `extend_tokens` positions, a typical drafted round), in ms: the median of `reps`
    interleaved repetitions after one warm-up."""
    from drelay_model.selectors.base import SelectionContext  # local: selectors import the drafter

    if reps < 1 or context_len < 2:
        raise DRelayError(f"measure_costs needs reps ≥ 1 and context_len ≥ 2, got {reps}, {context_len}")
    H = drafter.config.num_slots
    device = target.embed_weight.device
    layers = drafter.config.target_layer_ids
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (1, context_len), generator=g).to(device)
    cache = target.new_cache(1, context_len + H + 2)
    res = target(ids, cache, feature_layers=layers)
    ctx = drafter.new_context_cache(1, context_len + H + 2 + extend_tokens)
    drafter.extend_context(res.features, ctx)
    base, ctx_base = cache.lengths.clone(), ctx.lengths.clone()
    anchor = ids[:, -1]
    block = drafter.draft(anchor, ctx)
    sctx = SelectionContext(anchor_ids=anchor, anchor_pos=ctx.lengths.clone(), row_ids=torch.zeros(1, dtype=torch.long))
    if selector.capabilities.history_len:
        hist = torch.zeros(1, selector.capabilities.history_len, res.features.shape[-1], dtype=res.features.dtype, device=device)
        sctx = SelectionContext(anchor_ids=anchor, anchor_pos=sctx.anchor_pos, row_ids=sctx.row_ids, history=hist,
                                history_mask=torch.ones(hist.shape[:2], dtype=torch.bool, device=device))  # fmt: skip
    one_slot = dataclasses.replace(sctx, max_slots=1)
    # a partial-block selector decides one slot on a one-slot block (what a 1-draft round runs)
    one_block = drafter.draft(anchor, ctx, slots=1) if selector.capabilities.partial_block else block
    new_feats = res.features[:, -extend_tokens:]

    def verify(t: int) -> None:
        target(ids[:, :t], cache, feature_layers=layers)
        cache.crop(base)

    def extend() -> None:
        drafter.extend_context(new_feats, ctx)
        ctx.crop(ctx_base)

    calls = {("verify", t): (lambda t=t: verify(t)) for t in range(1, H + 2)}
    calls |= {("draft", h): (lambda h=h: drafter.draft(anchor, ctx, slots=h)) for h in range(1, H + 1)}
    calls |= {"pool_all": lambda: drafter.pool(block.hidden), "pool_one": lambda: drafter.pool(block.hidden[:, :1]),
              "select_one": lambda: selector.select(one_block, one_slot), "select_all": lambda: selector.select(block, sctx),
              "extend": extend}  # fmt: skip
    times: dict = defaultdict(list)
    for rep in range(reps + 1):  # repetition 0 warms up
        for key, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            if rep:
                times[key].append(1e3 * (time.perf_counter() - t0))
    ms = {key: statistics.median(v) for key, v in times.items()}
    verify_ms = tuple(isotonic([ms[("verify", t)] for t in range(1, H + 2)]))
    draft_slots_ms = tuple(isotonic([ms[("draft", h)] for h in range(1, H + 1)]))
    head_ms = max(ms["pool_all"] - ms["pool_one"], 0.0) / max(H - 1, 1)
    return VerifyCosts(
        verify_ms=verify_ms,
        block_ms=max(draft_slots_ms[-1] - H * head_ms, 0.0),
        head_ms=head_ms,
        select_ms=ms["select_one"],
        select_slot_ms=max(ms["select_all"] - ms["select_one"], 0.0) / max(H - 1, 1),
        extend_ms=ms["extend"],
        draft_slots_ms=draft_slots_ms,
    )
