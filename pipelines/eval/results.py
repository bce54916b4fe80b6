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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from drelay_model.decoding.stats import DecodeStats, tau_of
from drelay_model.diagnostics import PoolDiagnostics
from pipelines.common.store import JsonStore


@dataclass
class PassResult:
    """One decoding pass of a method over a benchmark: all prompts, one seed, one concurrency."""

    seed: int
    concurrency: int
    totals: DecodeStats  # every generate() call of the pass merged (`+`)

    def to_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "concurrency": self.concurrency, "totals": self.totals.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PassResult":
        return cls(d["seed"], d["concurrency"], DecodeStats.from_dict(d["totals"]))


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
    ar_wall_s: float | None = None  # paired timing: AR on the same prompt-turn, back to back
    ar_new_tokens: int | None = None
    tau_replay: float | None = None
    oracle_tau: float | None = None


PROMPT_COUNTS = ("rounds", "committed", "oracle_rounds", "oracle_committed")  # ReplayResult.per_prompt's columns


def prompt_key(prompt_id: str, turn: int) -> str:
    return f"{prompt_id}#{turn}"


@dataclass
class ReplayResult:
    """Greedy replay of a speculative method over AR's cached continuations: the totals, and the same
    counts per prompt turn (they sum to the totals; the bootstrap behind `drelay compare`'s intervals
    resamples them). Cells written before `per_prompt` existed read back with it empty."""

    rounds: int
    committed: int
    oracle_rounds: int
    oracle_committed: int
    diagnostics: PoolDiagnostics
    per_prompt: dict[str, list[int]] = field(default_factory=dict)  # "prompt_id#turn" → PROMPT_COUNTS

    @property
    def tau(self) -> float:
        return tau_of(self.committed, self.rounds)

    @property
    def oracle_tau(self) -> float:
        return tau_of(self.oracle_committed, self.oracle_rounds)

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
    other_cpu_share: float | None = None  # CPU share of other processes while the cell ran (timing.py)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["passes"] = [p.to_dict() for p in self.passes]
        d["prompts"] = [dataclasses.asdict(p) for p in self.prompts]
        d["replay"] = dataclasses.asdict(self.replay) if self.replay is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CellResult":
        replay = d.get("replay")
        if replay is not None:
            replay = ReplayResult.from_dict(replay)
        return cls(
            benchmark=d["benchmark"],
            method=d["method"],
            fingerprint=d["fingerprint"],
            passes=[PassResult.from_dict(p) for p in d["passes"]],
            prompts=[PromptRecord(**p) for p in d["prompts"]],
            outputs=d.get("outputs") or {},
            replay=replay,
            elapsed_s=d.get("elapsed_s", 0.0),
            other_cpu_share=d.get("other_cpu_share"),
        )


def fingerprint(settings: dict[str, Any]) -> str:
    """A short stable hash of everything that determines a cell's result."""
    blob = json.dumps(settings, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def cell_store(out_dir: str | Path) -> JsonStore[CellResult]:
    """`<out>/cells/<benchmark>__<method>.json`, written atomically as each cell finishes."""
    return JsonStore(Path(out_dir) / "cells", CellResult, lambda cell: cell.method)


def checkpoint_identity(path: str | None) -> str | None:
    """Path plus the size and mtime of its files: a retrained checkpoint in the same folder differs."""
    if not path:
        return None
    root = Path(path)
    files = sorted(f for f in root.rglob("*") if f.is_file()) if root.is_dir() else []
    return f"{root.resolve()}|" + ";".join(f"{f.name}:{f.stat().st_size}:{int(f.stat().st_mtime)}" for f in files)
