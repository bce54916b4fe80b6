"""The evaluation core: decode every benchmark with every method, on token ids, resumably.

For each benchmark, AR runs first (it is the reference for S, and its greedy output is cached as the
replay continuation), then each speculative method. A cell = (benchmark, method):

    for seed in seeds (one seed when greedy), for c in concurrency levels:
        decode the prompts in batches of c simultaneous requests          → PassResult (τ, tokens/s, phases)
        (timing "paired": each batch is also decoded by AR back to back, alternating which goes
        first, for S per prompt-turn that the machine's other load cannot skew: timing.py)
        (MT-Bench: turn 2 of each conversation follows the model's own turn-1 answer)
    greedy speculative methods: replay(selector) and replay(oracle) over AR's continuations
                                + pool diagnostics from the replay trace  → ReplayResult

Text never appears here: a `PromptEncoder` (pipelines/eval/prompts.py) turns turns + answers into ids.
Tracking is a callback (`on_cell`), so this module needs no MLflow and tests run it directly.
"""

from __future__ import annotations

import hashlib
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from drelay_model.decoding import GenerationConfig, SpeculativeEngine
from drelay_model.decoding.replay import replay
from drelay_model.decoding.stats import DecodeStats
from drelay_model.diagnostics import PoolDiagnostics, diagnose_rounds, pad_rounds
from drelay_model.drafter import BlockDrafter
from drelay_model.errors import DRelayError
from drelay_model.kernels.threads import ThreadPolicy
from drelay_model.selectors import Selector
from drelay_model.target import TargetModel
from pipelines.data.eval_sets import BenchmarkPrompt
from pipelines.eval.prompts import PromptEncoder
from pipelines.common.engines import DEFAULT_VERIFY_LENGTH, build_engine, check_verify_length
from pipelines.common.methods import AR, MethodSpec, load_method
from pipelines.common.replay_counts import ReplayCounts
from pipelines.common.store import JsonStore
from pipelines.eval.results import CellResult, PassResult, PromptRecord, ReplayResult, fingerprint, prompt_key
from pipelines.eval.results import checkpoint_identity
from pipelines.eval.timing import TIMINGS, CpuMeter

CellKey = tuple[str, str]  # (benchmark, method)
OnCell = Callable[[CellResult, bool], None]  # (cell, loaded_from_disk)


@dataclass(frozen=True)
class EvalConfig:
    """What to evaluate. `specs` starts with AR; `concurrency[0]` is the primary level (τ, S);
    `decode` holds the token budget and temperature (its seed is replaced per pass)."""

    target: str
    specs: tuple[MethodSpec, ...]
    benchmarks: tuple[str, ...]
    decode: GenerationConfig = GenerationConfig()
    seeds: tuple[int, ...] = (0,)
    concurrency: tuple[int, ...] = (1,)
    limit: int | None = None
    subset_seed: int = 0
    data_dir: str | None = None
    diagnostics: bool = True
    timing: str = "paired"  # "paired": AR alternates with the method per batch; "phased": AR's cell only
    verify_length: str = DEFAULT_VERIFY_LENGTH  # of the speculative methods' engines (`pipelines.common.engines`)
    threads: str = "auto"  # the engines' CPU thread policy: auto or a count (`drelay_model.kernels.threads`)

    def __post_init__(self) -> None:
        check_verify_length(self.verify_length)
        ThreadPolicy.parse(self.threads)
        if self.timing not in TIMINGS:
            raise DRelayError(f"timing must be one of {', '.join(TIMINGS)}, got {self.timing!r}")
        if not self.specs or not self.specs[0].is_ar:
            raise DRelayError(f"the method list must start with '{AR}' (the reference for speedup)")
        if not self.concurrency or min(self.concurrency) < 1:
            raise DRelayError(f"concurrency levels must be ≥ 1, got {list(self.concurrency)}")
        if not self.seeds:
            raise DRelayError("at least one seed is needed")

    @property
    def methods(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.specs)

    @property
    def checkpoints(self) -> dict[str, str | None]:
        return {s.name: s.checkpoint for s in self.specs}

    @property
    def random_drafter(self) -> bool:
        return any(s.random_drafter for s in self.specs)

    @property
    def greedy(self) -> bool:
        return self.decode.greedy

    @property
    def temperature(self) -> float:
        return self.decode.temperature

    @property
    def max_new_tokens(self) -> int:
        return self.decode.max_new_tokens

    @property
    def run_seeds(self) -> tuple[int, ...]:
        """Seeds actually decoded: greedy decoding is deterministic, so one suffices."""
        return self.seeds if not self.greedy else self.seeds[:1]

    def default_run_name(self) -> str:
        """Derived from the settings, so rerunning the same command resumes the same evaluation."""
        target = re.sub(r"[^A-Za-z0-9._+-]+", "_", Path(self.target).name or self.target)
        name = f"{target}-{'+'.join(self.methods)}-T{self.temperature:g}-{self.max_new_tokens}tok"
        name += "-match" if self.match_rule else ""
        name += "-fixed" if self.verify_length == "fixed" else ""
        return name + (f"-n{self.limit}" if self.limit else "") + ("-random" if self.random_drafter else "")

    @property
    def match_rule(self) -> bool:
        """T > 0 with the match rule (argmax path, drafts accepted while equal to samples)."""
        return not self.greedy and not self.decode.draft_sampling

    def as_params(self) -> dict[str, str]:
        """Flat MLflow params (stable names: runs stay comparable across versions)."""
        d = {"target": self.target, "methods": self.methods, "benchmarks": self.benchmarks, "temperature": self.temperature,
             "seeds": self.seeds, "max_new_tokens": self.max_new_tokens, "concurrency": self.concurrency, "limit": self.limit,
             "subset_seed": self.subset_seed, "checkpoints": self.checkpoints, "random_drafter": self.random_drafter,
             "data_dir": self.data_dir, "diagnostics": self.diagnostics, "timing": self.timing,
             "draft_sampling": self.decode.draft_sampling, "verify_length": self.verify_length, "threads": self.threads}  # fmt: skip
        return {k: ",".join(map(str, v)) if isinstance(v, tuple) else str(v) for k, v in d.items()}


@dataclass
class MethodUnderTest:
    """A loaded method: AR has neither drafter nor selector. `spec` keys its cost curve (None: AR)."""

    name: str
    drafter: BlockDrafter | None = None
    selector: Selector | None = None
    spec: MethodSpec | None = None

    @classmethod
    def load(cls, spec: MethodSpec, target: TargetModel, label: str | None = None) -> "MethodUnderTest":
        return cls(label or spec.name, *load_method(spec, target), spec=spec)

    def engine(self, target: TargetModel, verify_length: str, *, target_spec: str, threads: str = "auto") -> SpeculativeEngine:
        """A fresh engine (the factory's), on this method's loaded drafter and selector."""
        spec = self.spec if self.spec is not None else MethodSpec(AR)
        if self.drafter is not None and spec.is_ar:
            raise DRelayError(f"method '{self.name}' has a drafter but no spec to key its costs")
        return build_engine(target, spec, verify_length, target_spec=target_spec, method=(self.drafter, self.selector),
                            threads=ThreadPolicy.parse(threads))  # fmt: skip


@dataclass
class PassOutput:
    totals: DecodeStats
    records: list[PromptRecord]
    outputs: dict[str, list[list[int]]]  # prompt_id → generated ids per turn


def output_digest(tokens: Sequence[int]) -> str:
    return hashlib.sha1(",".join(map(str, tokens)).encode()).hexdigest()[:16]


def decode_pass(
    engine: SpeculativeEngine,
    prompts: Sequence[BenchmarkPrompt],
    encoder: PromptEncoder,
    *,
    config: EvalConfig,
    seed: int,
    concurrency: int,
    reference: SpeculativeEngine | None = None,
    bar=None,
) -> PassOutput:
    """Decode all prompts in batches of `concurrency` simultaneous requests; turn t+1 of a
    conversation is sent after the model's own answer to turn t. Timing covers prefill. With a
    `reference` (AR) engine each batch is decoded by both, back to back, the reference first on odd
    batches (paired timing); only the method's stats and outputs count as the pass."""
    out = PassOutput(DecodeStats(num_slots=engine.num_slots), [], {})
    for start in range(0, len(prompts), concurrency):
        chunk = prompts[start : start + concurrency]
        answers: list[list[list[int]]] = [[] for _ in chunk]
        for turn in range(max(len(p.turns) for p in chunk)):
            rows = [i for i, p in enumerate(chunk) if turn < len(p.turns)]
            ids = [encoder.encode(chunk[i].turns[: turn + 1], answers[i]) for i in rows]
            gen = config.decode.with_seed(seed * 1_000_003 + start * 101 + turn)
            ref = reference.generate(ids, gen) if reference is not None and (start // concurrency) % 2 else None
            res = engine.generate(ids, gen)
            if reference is not None and ref is None:
                ref = reference.generate(ids, gen)
            out.totals = out.totals + res.stats
            solo = len(rows) == 1
            for j, (i, prompt_ids, toks) in enumerate(zip(rows, ids, res.tokens)):
                answers[i].append(toks)
                out.records.append(PromptRecord(
                    prompt_id=chunk[i].prompt_id, turn=turn, seed=seed, prompt_tokens=len(prompt_ids),
                    new_tokens=len(toks), output_digest=output_digest(toks), rounds=res.stats.rounds if solo else None,
                    tau=res.stats.tau if solo else None, wall_s=res.stats.time_total,
                    ar_wall_s=ref.stats.time_total if ref is not None else None,
                    ar_new_tokens=len(ref.tokens[j]) if ref is not None else None,
                ))  # fmt: skip
        for p, a in zip(chunk, answers):
            out.outputs[p.prompt_id] = a
        if bar is not None:
            bar.update(len(chunk))
    return out


def replay_cell(
    target: TargetModel,
    method: MethodUnderTest,
    prompts: Sequence[BenchmarkPrompt],
    encoder: PromptEncoder,
    ar_outputs: Mapping[str, list[list[int]]],
    *,
    bar=None,
) -> tuple[ReplayResult, dict[tuple[str, int], tuple[float, float]]]:
    """Greedy replay of `method` (its selector, then the pool oracle) over AR's continuations, with
    pool diagnostics from the selector's trace. Returns the totals (with the counts per prompt turn in
    `per_prompt`) and (τ, oracle τ) per (prompt, turn).

    Prompts are replayed `REPLAY_BATCH` at a time (`replay(batch_size=…)`: each row's rounds are
    exactly those of replaying it alone); per-row counters come from the round hook."""
    diag, per_prompt, prompt_counts = PoolDiagnostics(), {}, {}
    counts = [0, 0, 0, 0]  # rounds, committed, oracle rounds, oracle committed
    for lo in range(0, len(prompts), REPLAY_BATCH):
        chunk = prompts[lo : lo + REPLAY_BATCH]
        keys, ids, conts = [], [], []
        for p in chunk:
            answers = ar_outputs.get(p.prompt_id)
            if answers is None:
                raise DRelayError(f"no cached AR output for {p.benchmark} prompt {p.prompt_id!r}; rerun the AR cell")
            for turn, cont in enumerate(answers):
                keys.append((p.prompt_id, turn))
                ids.append(encoder.encode(p.turns[: turn + 1], answers[:turn]))
                conts.append(cont)
        trace, sel_rows, ora_rows = [], ReplayCounts(len(keys)), ReplayCounts(len(keys))

        def hook(r):
            trace.append((r.block.cand_ids[0], r.path, r.ref))
            sel_rows.add(r)

        st = replay(target, method.drafter, ids, conts, selector=method.selector, on_round=hook, batch_size=REPLAY_BATCH)
        ost = replay(target, method.drafter, ids, conts, oracle=True, on_round=ora_rows.add, batch_size=REPLAY_BATCH)
        if trace:
            diag = diag + diagnose_rounds(*pad_rounds(trace))
        counts = [a + b for a, b in zip(counts, (st.rounds, st.committed, ost.rounds, ost.committed))]
        for row, key in enumerate(keys):
            per_prompt[key] = (sel_rows.tau(row), ora_rows.tau(row))
            sel, ora = (sel_rows.rounds[row], sel_rows.committed[row]), (ora_rows.rounds[row], ora_rows.committed[row])
            prompt_counts[prompt_key(*key)] = [*sel, *ora]  # PROMPT_COUNTS
        if bar is not None:
            bar.update(len(chunk))
    return ReplayResult(*counts, diagnostics=diag, per_prompt=prompt_counts), per_prompt


REPLAY_BATCH = 8  # prompts (turns) per replay call


class Evaluation:
    """Runs (or resumes) all cells of an `EvalConfig` over loaded methods and prompts."""

    def __init__(
        self,
        config: EvalConfig,
        target: TargetModel,
        methods: Mapping[str, MethodUnderTest],
        prompts: Mapping[str, Sequence[BenchmarkPrompt]],
        encoder: PromptEncoder,
        store: JsonStore[CellResult],
        *,
        progress: bool = True,
    ) -> None:
        self.config, self.target, self.methods = config, target, methods
        self.prompts, self.encoder, self.store, self.progress = prompts, encoder, store, progress
        self._warm: set[str] = set()
        for name in config.methods:
            sel = methods[name].selector
            if not config.greedy and sel is not None and not sel.capabilities.supports_sampling:
                raise DRelayError(f"method '{name}' does not support sampling (temperature > 0)")

    def check_prompt_lengths(self) -> None:
        """Fail before any decoding if a first-turn prompt cannot fit the context window with the
        token budget (later turns depend on answers and are checked by the engine)."""
        slots = max((m.drafter.config.num_slots for m in self.methods.values() if m.drafter is not None), default=0)
        for bench, prompts in self.prompts.items():
            for p in prompts:
                n = len(self.encoder.encode(p.turns[:1], []))
                self.config.decode.check_prompt(
                    n, max_positions=self.target.max_positions, num_slots=slots, what=f"{bench} prompt {p.prompt_id!r}"
                )

    def fingerprint(self, benchmark: str, method: str) -> str:
        c = self.config
        return fingerprint({
            "target": c.target, "method": method, "benchmark": benchmark, "temperature": c.temperature,
            "seeds": c.run_seeds, "max_new_tokens": c.max_new_tokens, "concurrency": c.concurrency,
            "random_drafter": c.random_drafter, "diagnostics": c.diagnostics,
            "checkpoint": checkpoint_identity(c.checkpoints.get(method)) if method != AR else None,
            "prompt_ids": [p.prompt_id for p in self.prompts[benchmark]],
            # Paired cells differ from phased ones (the cells written before paired timing existed);
            # AR's own cell is the same either way.
            **({"timing": "paired"} if c.timing == "paired" and method != AR else {}),
            **({"rule": "match"} if c.match_rule and method != AR else {}),
            **({"verify_length": "cost"} if c.verify_length == "cost" and method != AR else {}),
        })  # fmt: skip

    def run(self, on_cell: OnCell | None = None) -> dict[CellKey, CellResult]:
        """All cells, benchmark-major (AR first per benchmark); finished cells are loaded, not rerun."""
        c = self.config
        cells: dict[CellKey, CellResult] = {}
        with tqdm(
            total=len(c.benchmarks) * len(c.methods), desc="cells", unit="cell", disable=not self.progress, file=sys.stderr
        ) as bar:
            for bench in c.benchmarks:
                for name in c.methods:
                    bar.set_postfix_str(f"{bench}/{name}")
                    fp = self.fingerprint(bench, name)
                    cell = self.store.load(bench, name, fp)
                    loaded = cell is not None
                    if cell is None:
                        cell = self.run_cell(bench, name, fp, ar_cell=cells.get((bench, AR)))
                        self.store.save(cell)
                    cells[(bench, name)] = cell
                    if on_cell is not None:
                        on_cell(cell, loaded)
                    bar.update(1)
        return cells

    def run_cell(self, bench: str, name: str, fp: str, *, ar_cell: CellResult | None) -> CellResult:
        c, method, prompts = self.config, self.methods[name], self.prompts[bench]
        t0, meter = time.perf_counter(), CpuMeter()
        engine = method.engine(self.target, c.verify_length, target_spec=c.target, threads=c.threads)
        self._warm_up(name, engine, prompts[0])
        reference = None
        if c.timing == "paired" and name != AR:
            reference = self.methods[AR].engine(self.target, c.verify_length, target_spec=c.target, threads=c.threads)
            self._warm_up(AR, reference, prompts[0])
        cell = CellResult(benchmark=bench, method=name, fingerprint=fp, passes=[], prompts=[])
        for seed in c.run_seeds:
            for conc in c.concurrency:
                desc = f"{bench}/{name} seed={seed} c={conc}"
                with tqdm(
                    total=len(prompts), desc=desc, unit="prompt", leave=False, disable=not self.progress, file=sys.stderr
                ) as bar:
                    po = decode_pass(
                        engine, prompts, self.encoder, config=c, seed=seed, concurrency=conc, reference=reference, bar=bar
                    )
                cell.passes.append(PassResult(seed, conc, po.totals))
                if conc == c.concurrency[0]:
                    cell.prompts += po.records
                    if name == AR and c.greedy and seed == c.run_seeds[0]:
                        cell.outputs = po.outputs
        if c.greedy and c.diagnostics and method.drafter is not None and ar_cell is not None:
            with tqdm(
                total=len(prompts),
                desc=f"{bench}/{name} replay",
                unit="prompt",
                leave=False,
                disable=not self.progress,
                file=sys.stderr,
            ) as bar:
                cell.replay, per_prompt = replay_cell(self.target, method, prompts, self.encoder, ar_cell.outputs, bar=bar)
            for r in cell.prompts:
                r.tau_replay, r.oracle_tau = per_prompt.get((r.prompt_id, r.turn), (None, None))
        cell.elapsed_s = time.perf_counter() - t0
        cell.other_cpu_share = meter.other_share()
        return cell

    def _warm_up(self, name: str, engine: SpeculativeEngine, prompt: BenchmarkPrompt) -> None:
        """One short untimed generation per method, so one-time costs do not land in the first cell."""
        if name in self._warm:
            return
        ids = self.encoder.encode(prompt.turns[:1], [])
        engine.generate([ids], GenerationConfig(max_new_tokens=min(4, self.config.max_new_tokens)))
        self._warm.add(name)
