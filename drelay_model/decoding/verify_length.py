"""Cost-aware verification length: how many path tokens a round verifies (0 = a plain AR step).

A round that verifies L drafts commits 1 + A tokens, A = the accepted drafts. With p_i = P(draft i is
accepted | drafts 1..i−1 were), its expectation is

    E(L) = 1 + Σ_{i=1..L} Π_{j≤i} p_j

and it costs t(L) = t_block + L·t_head + t_select + t_verify(1 + L) (t(0) = t_verify(1): no drafting).
The policy picks the L that maximises committed tokens per millisecond, E(L) / t(L), in two steps:

  plan    before drafting, from running per-slot acceptance rates â_i (no pool yet): L_plan, the
          number of slots whose LM head the drafter evaluates; 0 skips the drafter (an AR round).
          While AR wins, a drafted round still runs every `probe` rounds to keep â current (the
          interval doubles while probes keep losing, up to `max_probe`).
  choose  after drafting, per row, from the pool: p_i = the calibrated confidence of the chosen
          candidate (its draft probability q, mapped through running acceptance counts per q-bin),
          L ≤ L_plan maximising E(L) / (t_sunk + t_verify(1 + L)) — drafting is already paid for.
  observe after verification, the accepted counts update â_i and the calibration bins.

Verifying fewer tokens never changes what is committed: verification accepts only drafts that equal
the target's own tokens, whatever L is (tests cover every L, 0 included). The cost curve is measured
once per machine, target and drafter (`measure_costs`) and cached as JSON.

Shapes: B rows, H slots.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from drelay_model.errors import DRelayError

_BINS = 10  # calibration bins over q ∈ [0, 1]


@dataclass(frozen=True)
class VerifyCosts:
    """Measured costs in milliseconds (batch of one row).

    verify_ms  [H + 1] target forward over t = 1 .. H + 1 new tokens on a cached context
    block_ms   drafter layers over one block (everything but the LM head)
    head_ms    LM head + top-K for one slot
    select_ms  the selector over one block, deciding one slot (`SelectionContext.max_slots` = 1)
    select_slot_ms  each further decided slot (0 for a selector whose cost does not depend on it;
               files written before it existed hold the whole block's cost in select_ms)
    """

    verify_ms: tuple[float, ...]
    block_ms: float
    head_ms: float
    select_ms: float
    select_slot_ms: float = 0.0

    def __post_init__(self) -> None:
        if not self.verify_ms or any(not (t > 0 and math.isfinite(t)) for t in self.verify_ms):
            raise DRelayError(f"verify_ms must be positive and finite, got {self.verify_ms}")
        if any(not (t >= 0 and math.isfinite(t)) for t in (self.block_ms, self.head_ms, self.select_ms, self.select_slot_ms)):
            raise DRelayError("block_ms, head_ms, select_ms and select_slot_ms must be finite and ≥ 0")

    @property
    def max_slots(self) -> int:
        return len(self.verify_ms) - 1

    def draft_ms(self, head_slots: int, decided: int | None = None) -> float:
        """Drafting with the LM head over `head_slots` slots + selecting `decided` of them (default:
        all of them); 0 with no drafting."""
        if head_slots == 0:
            return 0.0
        decided = head_slots if decided is None else decided
        return self.block_ms + head_slots * self.head_ms + self.select_ms + max(decided - 1, 0) * self.select_slot_ms

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
                       select_slot_ms=float(raw.get("select_slot_ms", 0.0)))  # fmt: skip
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DRelayError(f"cannot read verification costs from {path}: {exc}") from exc


def expected_committed(p: torch.Tensor) -> torch.Tensor:
    """E(L) for L = 0 .. H from per-slot conditional acceptance p [..., H] → [..., H + 1]."""
    reach = torch.cumprod(p, dim=-1)  # [..., H] P(drafts 1..i all accepted)
    return 1.0 + torch.cat([torch.zeros_like(reach[..., :1]), reach.cumsum(dim=-1)], dim=-1)


@dataclass
class CostAwareLength:
    """The per-generate() policy state (create one per engine call; see the module docstring)."""

    costs: VerifyCosts
    num_slots: int
    probe: int = 4
    max_probe: int = 64
    prior: float = 4.0  # pseudo-counts pulling a calibration bin towards its raw q
    slot_rate: torch.Tensor = field(init=False)  # [H] â_i, running
    bin_hits: torch.Tensor = field(init=False)  # [BINS] accepted drafts per q-bin
    bin_seen: torch.Tensor = field(init=False)  # [BINS] verified drafts per q-bin
    _since_probe: int = 0
    _interval: int = 0

    def __post_init__(self) -> None:
        if self.num_slots > self.costs.max_slots:
            raise DRelayError(f"costs cover {self.costs.max_slots} slots, the drafter has {self.num_slots}: re-measure them")
        self.slot_rate = torch.full((self.num_slots,), 0.5, dtype=torch.float64)
        self.bin_hits = torch.zeros(_BINS, dtype=torch.float64)
        self.bin_seen = torch.zeros(_BINS, dtype=torch.float64)
        self._interval = self.probe

    # ---- before drafting -------------------------------------------------------------------------
    def plan(self, *, partial: bool = True) -> int:
        """How many slots to draft heads for this round (0: an AR round). partial=False: the
        selector needs all H heads whatever is verified, so drafting always costs the full block."""
        e = expected_committed(self.slot_rate)  # [H + 1]
        H = self.num_slots
        draft = [self.costs.draft_ms(L if partial or L == 0 else H, decided=L) for L in range(H + 1)]
        t = torch.tensor([draft[L] + self.costs.verify_ms[L] for L in range(H + 1)], dtype=torch.float64)
        best = int((e / t).argmax())
        if best > 0:
            self._interval, self._since_probe = self.probe, 0
            return best
        self._since_probe += 1
        if self._since_probe >= self._interval:  # probe: draft anyway to keep the estimates current
            self._since_probe, self._interval = 0, min(2 * self._interval, self.max_probe)
            return int((e[1:] / t[1:]).argmax()) + 1
        return 0

    # ---- after drafting --------------------------------------------------------------------------
    def confidence(self, q: torch.Tensor) -> torch.Tensor:
        """Calibrated P(accept) for chosen-candidate draft probabilities q [...] (float in [0, 1])."""
        b = (q * _BINS).long().clamp(0, _BINS - 1)
        return ((self.bin_hits[b] + self.prior * q.double()) / (self.bin_seen[b] + self.prior)).clamp(0.0, 1.0)

    def choose(self, q: torch.Tensor, head_slots: int) -> torch.Tensor:
        """Per-row verification length ≤ P from the chosen candidates' q [B, P] (the planned slots)
        → [B] int64 (on q's device; the policy's own state lives on the CPU). head_slots: the slots
        drafted with an LM head this round (≥ P), whose cost is already spent."""
        p = self.confidence(q.detach().cpu())  # [B, P]
        e = expected_committed(p)  # [B, P + 1]
        sunk = self.costs.draft_ms(head_slots, decided=q.shape[1])
        t = torch.tensor([sunk + self.costs.verify_ms[L] for L in range(q.shape[1] + 1)], dtype=torch.float64)
        return (e / t).argmax(dim=-1).to(q.device)

    # ---- after verification ----------------------------------------------------------------------
    def observe(self, q: torch.Tensor, length: torch.Tensor, accepted: torch.Tensor, decay: float = 0.9) -> None:
        """Update â_i and the calibration bins from one round: q [B, G], length/accepted [B]."""
        q, length, accepted = q.detach().cpu(), length.cpu(), accepted.cpu()
        G = q.shape[1]
        i = torch.arange(G)[None, :]
        reached = (i < length[:, None]) & (i <= accepted[:, None])  # draft i was verified with i−1 accepted
        hit = i < accepted[:, None]
        b = (q * _BINS).long().clamp(0, _BINS - 1)
        self.bin_seen.index_add_(0, b[reached], torch.ones(int(reached.sum()), dtype=torch.float64))
        self.bin_hits.index_add_(0, b[reached & hit], torch.ones(int((reached & hit).sum()), dtype=torch.float64))
        n = reached.sum(dim=0)[: self.num_slots].double()  # [G]
        rate = hit.sum(dim=0)[: self.num_slots].double() / n.clamp(min=1)
        seen = n > 0
        self.slot_rate[:G][seen] = decay * self.slot_rate[:G][seen] + (1 - decay) * rate[seen]


@torch.inference_mode()
def measure_costs(target, drafter, selector, *, context_len: int = 200, reps: int = 5) -> VerifyCosts:
    """Time one row's verify(1 .. H + 1), drafter block, LM head per slot and selection (ms; the
    fastest of `reps` calls each, verify made non-decreasing in its width)."""
    H = drafter.config.num_slots
    device = target.embed_weight.device
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (1, context_len), generator=g).to(device)
    cache = target.new_cache(1, context_len + H + 2)
    res = target(ids, cache, feature_layers=drafter.config.target_layer_ids)
    ctx = drafter.new_context_cache(1, context_len + H + 2)
    drafter.extend_context(res.features, ctx)
    base = cache.lengths.clone()

    def fastest_ms(fn) -> float:
        """The fastest of `reps` calls after a warm-up: other processes only ever add time, so the
        minimum is the best estimate of the call's own cost on a shared machine."""
        times = []
        for _ in range(reps + 1):  # the first call warms up
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        return min(times[1:])

    def verify(t: int) -> None:
        target(ids[:, :t], cache, feature_layers=drafter.config.target_layer_ids)
        cache.crop(base)

    raw = [fastest_ms(lambda t=t: verify(t)) for t in range(1, H + 2)]
    verify_ms = tuple(max(raw[: i + 1]) for i in range(len(raw)))  # verifying more tokens never costs less
    anchor = ids[:, -1]
    block = drafter.draft(anchor, ctx)
    full = fastest_ms(lambda: drafter.draft(anchor, ctx))
    one = fastest_ms(lambda: drafter.draft(anchor, ctx, head_slots=1))
    head_ms = max(full - one, 0.0) / max(H - 1, 1)
    block_ms = max(one - head_ms, 0.0)
    from drelay_model.selectors.base import SelectionContext  # local: selectors import the drafter

    sctx = SelectionContext(anchor_ids=anchor, anchor_pos=ctx.lengths.clone(), row_ids=torch.zeros(1, dtype=torch.long))
    if selector.capabilities.history_len:
        hist = torch.zeros(1, selector.capabilities.history_len, res.features.shape[-1], dtype=res.features.dtype, device=device)
        sctx = SelectionContext(anchor_ids=anchor, anchor_pos=sctx.anchor_pos, row_ids=sctx.row_ids, history=hist,
                                history_mask=torch.ones(hist.shape[:2], dtype=torch.bool, device=device))  # fmt: skip
    one_slot = dataclasses.replace(sctx, max_slots=1)
    select_one = fastest_ms(lambda: selector.select(block, one_slot))
    select_all = fastest_ms(lambda: selector.select(block, sctx))
    select_slot_ms = max(select_all - select_one, 0.0) / max(H - 1, 1)
    return VerifyCosts(verify_ms=verify_ms, block_ms=block_ms, head_ms=head_ms, select_ms=select_one, select_slot_ms=select_slot_ms)
