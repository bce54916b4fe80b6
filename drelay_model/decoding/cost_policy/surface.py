"""The cost policy's round costs: the measured surface of a round's cost over batch size.

A round over b rows that drafts h slots, decides d of them and verifies L per row costs

    t(b; h, d, L) = draft(b, h) + select(b) + (d − 1)·select_slot(b) + extend(b) + verify(b, 1 + L)
    t(b; h, 0, L) = draft(b, h) + extend(b) + verify(b, 1 + L)        (the native path, no selector call)
    t(b; 0, 0, 0) = verify(b, 1)                                      (an AR round for the whole batch)

verify(b, t) is one target forward over b rows × t new tokens on a cached context; draft(b, h) the
drafter over b blocks of the anchor and h masked positions, with an LM head on each
(`BlockDrafter.draft(slots=h)`); a selector that reads the whole pool always pays draft(b, H).

Every term is measured at a grid of batch sizes b_1 = 1 < b_2 < … (`surface_batches`: powers of two
up to the batcher's max_batch) and is linear in b between grid points (beyond the last one, the last
segment's slope continues). b = 1 is one point of the surface: a single-row engine reads the same
tables at b = 1. Along the width, verify(b, t) is timed at t ∈ {1, 2, 3, 5, 9, 17, …, H + 1} and
draft(b, h) at h ∈ {1, 2, 4, 8, …, H} (`verify_widths`, `draft_widths`: dense where a round's
choices crowd, then doubling) and is linear in between: both are sums of per-token matmuls plus a fixed overhead, so the
line between two timed widths is what a timing in between would give, at a third of the calls.

The surface is measured by `measure.py` and cached per machine by `cache.py`; the policy
(`policy.py`) rescales it online from the rounds it times.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path


from drelay_model.errors import DRelayError

# What `measure_costs` measures, versioned: 2 = draft(h) per length, 3 = a partial-block selector's
# select_ms on a one-slot block, 4 = every term over batch sizes, 5 = the other processes' CPU use
# while measuring (`busy_cores`). A cached file of an older version is measured again.
COSTS_VERSION = 5

Table = tuple[tuple[float, ...], ...]


class StaleCosts(DRelayError):
    """A cost file written by an older measurement (its `version` < COSTS_VERSION)."""


def surface_batches(max_batch: int) -> tuple[int, ...]:
    """The batch sizes measured for a batcher of `max_batch` rows: 1, 2, 4, … < max_batch, max_batch."""
    if max_batch < 1:
        raise DRelayError(f"max_batch must be ≥ 1, got {max_batch}")
    sizes = [1 << k for k in range(max_batch.bit_length()) if 1 << k < max_batch]
    return (*sizes, max_batch)


def verify_widths(H: int) -> tuple[int, ...]:
    """The verify widths timed for H slots: t = 1, 2, 3, then 2^k + 1 (the anchor and 2^k drafts),
    and H + 1."""
    doubling = {(1 << k) + 1 for k in range(2, 8) if (1 << k) + 1 <= H}
    return tuple(sorted({t for t in (1, 2, 3) if t <= H + 1} | doubling | {H + 1}))


def draft_widths(H: int) -> tuple[int, ...]:
    """The drafted slot counts timed for H slots: h = 1, 2, 4, 8, … < H, and H (none when H = 0)."""
    return tuple(sorted({1 << k for k in range(8) if 1 << k < H} | ({H} if H else set())))


def fill_linear(points: tuple[int, ...], values: list[float], n: int) -> list[float]:
    """values timed at `points` (ascending, from 1 to n) → a value at every width 1 … n, linear between."""
    return [_interp(points, tuple(values), w) for w in range(1, n + 1)]


def check_batch_sizes(sizes: tuple[int, ...]) -> tuple[int, ...]:
    """A grid of batch sizes must ascend strictly from 1."""
    if not sizes or sizes[0] != 1 or any(a >= b for a, b in zip(sizes, sizes[1:])):
        raise DRelayError(f"batch_sizes must ascend strictly from 1, got {tuple(sizes)}")
    return tuple(sizes)


def _interp(xs: tuple[int, ...], ys: tuple[float, ...], x: float) -> float:
    """ys linear in x between the grid points xs; the last segment's slope (≥ 0) continues past
    them; below xs[0] the first value."""
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    for i in range(1, len(xs)):
        if x <= xs[i] or i == len(xs) - 1:
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            slope = (y1 - y0) / (x1 - x0)
            if x > x1:
                slope = max(slope, 0.0)
            return y0 + slope * (x - x0)
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class RoundCosts:
    """Measured costs in milliseconds over batch sizes (the module docstring).

    batch_sizes     [N] ascending grid of batch sizes, starting at 1
    busy_cores      cores' worth of CPU other processes used while these were measured (0 where
                    unknown): the cache measures again a surface taken on a busy machine
    verify_ms       [N][H + 1] target forward over b rows × t = 1 .. H + 1 new tokens
    draft_slots_ms  [N][H] the drafter over b blocks of h = 1 .. H slots, LM heads included
    select_ms       [N] the selector deciding one slot per row (`SelectionContext.max_slots` = 1) on a
                    whole block, or on a one-slot block for a partial-block selector
    select_slot_ms  [N] each further decided slot (0 for a selector whose cost does not depend on it)
    extend_ms       [N] extending the drafter's context by a drafted round's verified positions

    A flat verify_ms / draft_slots_ms and scalar select/extend terms give a one-point surface at b = 1
    (what synthetic costs in tests use).
    """

    verify_ms: Table
    draft_slots_ms: Table
    select_ms: tuple[float, ...]  # (a number: the same at every batch size, normalised to a tuple)
    select_slot_ms: tuple[float, ...] = 0.0
    extend_ms: tuple[float, ...] = 0.0
    batch_sizes: tuple[int, ...] = (1,)
    busy_cores: float = 0.0
    version: int = COSTS_VERSION  # of the measurement

    def __post_init__(self) -> None:
        n = len(check_batch_sizes(self.batch_sizes))
        for name in ("verify_ms", "draft_slots_ms"):
            value = getattr(self, name)
            flat = not value or not isinstance(value[0], (list, tuple))
            table = (tuple(float(t) for t in value),) if flat else tuple(tuple(float(t) for t in row) for row in value)
            object.__setattr__(self, name, table)
        object.__setattr__(self, "busy_cores", float(self.busy_cores))
        if not (self.busy_cores >= 0 and math.isfinite(self.busy_cores)):
            raise DRelayError(f"busy_cores must be ≥ 0 and finite, got {self.busy_cores}")
        for name in ("select_ms", "select_slot_ms", "extend_ms"):
            value = getattr(self, name)
            value = (value,) * n if isinstance(value, (int, float)) else tuple(value)
            object.__setattr__(self, name, tuple(float(t) for t in value))
        H = len(self.verify_ms[0]) - 1
        if len(self.verify_ms) != n or any(len(r) != H + 1 for r in self.verify_ms) or H < 0:
            raise DRelayError(f"verify_ms must hold {n} rows of equal length ≥ 1 (one per batch size)")
        if any(not (t > 0 and math.isfinite(t)) for r in self.verify_ms for t in r):
            raise DRelayError(f"verify_ms must be positive and finite, got {self.verify_ms}")
        if len(self.draft_slots_ms) != n or any(len(r) != H for r in self.draft_slots_ms):
            raise DRelayError(f"draft_slots_ms must hold {n} rows of {H} times (one per batch size and slot count)")
        if any(not (t > 0 and math.isfinite(t)) for r in self.draft_slots_ms for t in r):
            raise DRelayError(f"draft_slots_ms must be positive and finite, got {self.draft_slots_ms}")
        for name in ("select_ms", "select_slot_ms", "extend_ms"):
            value = getattr(self, name)
            if len(value) != n or any(not (t >= 0 and math.isfinite(t)) for t in value):
                raise DRelayError(f"{name} must hold {n} finite times ≥ 0 (one per batch size), got {value}")

    @property
    def max_slots(self) -> int:
        return len(self.verify_ms[0]) - 1

    @property
    def max_batch(self) -> int:
        """The largest measured batch size (larger ones are extrapolated)."""
        return self.batch_sizes[-1]

    def _at(self, column: list[float] | tuple[float, ...], batch: float) -> float:
        return _interp(self.batch_sizes, tuple(column), batch)

    def verify(self, width: int, batch: float = 1) -> float:
        """A target forward over `batch` rows × `width` tokens (the anchor + width − 1 drafts)."""
        return self._at([row[width - 1] for row in self.verify_ms], batch)

    def extend(self, batch: float = 1) -> float:
        return self._at(self.extend_ms, batch)

    def draft_ms(self, head_slots: int, decided: int | None = None, batch: float = 1) -> float:
        """Drafting `head_slots` slots for `batch` rows, selecting `decided` of them (default: all of
        them; 0: the native path, no selector call) and extending the drafter's context afterwards;
        0 with no drafting."""
        if head_slots == 0:
            return 0.0
        decided = head_slots if decided is None else decided
        select = 0.0
        if decided > 0:  # 0: no selector ran
            select = self._at(self.select_ms, batch) + (decided - 1) * self._at(self.select_slot_ms, batch)
        drafting = self._at([row[head_slots - 1] for row in self.draft_slots_ms], batch)
        return drafting + select + self.extend(batch)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> "RoundCosts":
        """The surface in `path`; StaleCosts for a file of an older version, DRelayError (one line)
        for anything else unreadable."""
        try:
            raw = json.loads(Path(path).read_text())
            version = int(raw.get("version", 1)) if isinstance(raw, dict) else 0
        except (OSError, ValueError, TypeError) as exc:
            raise DRelayError(f"cannot read verification costs from {path}: {exc}") from exc
        if 0 < version < COSTS_VERSION:
            raise StaleCosts(f"the costs at {path} predate what is measured now (version {version} < {COSTS_VERSION})")
        try:
            fields = {f.name for f in dataclasses.fields(cls)}
            if set(raw) != fields:
                raise KeyError(f"expected the fields {sorted(fields)}, got {sorted(raw)}")
            return cls(**{**raw, "batch_sizes": tuple(int(b) for b in raw["batch_sizes"])})
        except (ValueError, KeyError, TypeError) as exc:
            raise DRelayError(f"cannot read verification costs from {path}: {exc}") from exc
