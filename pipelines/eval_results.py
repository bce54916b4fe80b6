"""Result records of an evaluation and their on-disk store (one JSON file per finished cell).

A *cell* is one (benchmark, method) pair: every decoding pass of that method over the benchmark's
prompts (one per seed × concurrency level), per-prompt records, and — for greedy runs of
speculative methods — the replay τ, oracle τ and pool diagnostics. Cells are written as they finish,
so an interrupted evaluation resumes by skipping cells whose file exists with the same fingerprint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from drelay_model.decoding.stats import DecodeStats, ms_per_step_of, slot_acceptance_of, tau_of
from drelay_model.diagnostics import PoolDiagnostics


@dataclass
class DecodeTotals:
    """`DecodeStats` summed over several generate() calls (and mergeable across cells).

    accept_hist [H+1]: accept_hist[n] = row-rounds that accepted exactly n drafts. Times in seconds.
    `requests` counts generate() rows (prefills); `steps` counts batched engine iterations.
    """

    num_slots: int
    generated: int = 0
    committed: int = 0
    rounds: int = 0
    steps: int = 0
    requests: int = 0
    accept_hist: list[int] = field(default_factory=list)
    time_prefill: float = 0.0
    time_draft: float = 0.0
    time_select: float = 0.0
    time_verify: float = 0.0
    time_total: float = 0.0

    def __post_init__(self) -> None:
        if not self.accept_hist:
            self.accept_hist = [0] * (self.num_slots + 1)

    def add(self, stats: DecodeStats, requests: int) -> None:
        for name in ("generated", "committed", "rounds", "steps"):
            setattr(self, name, getattr(self, name) + getattr(stats, name))
        for name in ("time_prefill", "time_draft", "time_select", "time_verify", "time_total"):
            setattr(self, name, getattr(self, name) + getattr(stats, name))
        self.accept_hist = [a + b for a, b in zip(self.accept_hist, stats.accept_hist.tolist())]
        self.requests += requests

    def __add__(self, other: "DecodeTotals") -> "DecodeTotals":
        out = DecodeTotals(num_slots=max(self.num_slots, other.num_slots))
        for f in dataclasses.fields(self):
            if f.name not in ("num_slots", "accept_hist"):
                setattr(out, f.name, getattr(self, f.name) + getattr(other, f.name))
        hist = [0] * (out.num_slots + 1)
        for h in (self.accept_hist, other.accept_hist):
            for i, v in enumerate(h):
                hist[i] += v
        out.accept_hist = hist
        return out

    @property
    def tau(self) -> float:
        """Tokens committed per verification round (prefill tokens excluded, as in DecodeStats)."""
        return tau_of(self.committed, self.rounds)

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per wall second, prefill included (the S numerator/denominator)."""
        return self.generated / self.time_total if self.time_total > 0 else 0.0

    def slot_acceptance(self) -> list[float]:
        """P(draft at slot i accepted), i = 1..H: share of rounds that accepted ≥ i drafts."""
        return slot_acceptance_of(self.accept_hist, self.rounds)

    def ms_per_step(self) -> dict[str, float]:
        """Mean ms per engine step (= per round at concurrency 1) by phase; prefill excluded."""
        return ms_per_step_of(self.steps, self.time_prefill, self.time_draft, self.time_select, self.time_verify, self.time_total)

    @property
    def ms_prefill(self) -> float:
        """Mean prefill ms per request."""
        return 1e3 * self.time_prefill / self.requests if self.requests else 0.0


@dataclass
class PassResult:
    """One decoding pass of a method over a benchmark: all prompts, one seed, one concurrency."""

    seed: int
    concurrency: int
    totals: DecodeTotals


@dataclass
class PromptRecord:
    """One (prompt, turn) of the primary pass; round fields are None when it shared a batch."""

    prompt_id: str
    turn: int
    seed: int
    prompt_tokens: int
    new_tokens: int
    output_digest: str
    rounds: int | None = None
    tau: float | None = None
    wall_s: float | None = None
    tau_replay: float | None = None
    oracle_tau: float | None = None


@dataclass
class ReplayResult:
    """Greedy replay of a speculative method over AR's cached continuations."""

    rounds: int
    committed: int
    oracle_rounds: int
    oracle_committed: int
    diagnostics: PoolDiagnostics

    @property
    def tau(self) -> float:
        return self.committed / self.rounds if self.rounds else 0.0

    @property
    def oracle_tau(self) -> float:
        return self.oracle_committed / self.oracle_rounds if self.oracle_rounds else 0.0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ReplayResult":
        return cls(**{**d, "diagnostics": PoolDiagnostics(**d["diagnostics"])})


@dataclass
class CellResult:
    """Everything measured for one (benchmark, method); `outputs` holds AR's greedy tokens only."""

    benchmark: str
    method: str
    fingerprint: str
    passes: list[PassResult]
    prompts: list[PromptRecord]
    outputs: dict[str, list[list[int]]] = field(default_factory=dict)
    replay: ReplayResult | None = None
    elapsed_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CellResult":
        replay = d.get("replay")
        if replay is not None:
            replay = ReplayResult.from_dict(replay)
        return cls(
            benchmark=d["benchmark"],
            method=d["method"],
            fingerprint=d["fingerprint"],
            passes=[PassResult(p["seed"], p["concurrency"], DecodeTotals(**p["totals"])) for p in d["passes"]],
            prompts=[PromptRecord(**p) for p in d["prompts"]],
            outputs=d.get("outputs") or {},
            replay=replay,
            elapsed_s=d.get("elapsed_s", 0.0),
        )


def fingerprint(settings: dict[str, Any]) -> str:
    """A short stable hash of everything that determines a cell's result."""
    blob = json.dumps(settings, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


class CellStore:
    """`<out>/cells/<benchmark>__<method>.json`, written atomically as each cell finishes."""

    def __init__(self, out_dir: str | Path) -> None:
        self.root = Path(out_dir) / "cells"

    def path(self, benchmark: str, method: str) -> Path:
        return self.root / f"{benchmark}__{method}.json"

    def load(self, benchmark: str, method: str, fp: str) -> CellResult | None:
        """The stored cell if it exists, parses and matches `fp`; None otherwise (recompute)."""
        path = self.path(benchmark, method)
        if not path.is_file():
            return None
        try:
            cell = CellResult.from_dict(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError):
            return None  # a torn or outdated file: recompute it
        return cell if cell.fingerprint == fp else None

    def save(self, cell: CellResult) -> Path:
        path = self.path(cell.benchmark, cell.method)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(cell.to_dict()))
        os.replace(tmp, path)
        return path
