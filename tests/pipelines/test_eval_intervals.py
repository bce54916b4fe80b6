"""`drelay eval`'s 95% intervals of τ and S: resampled over each benchmark's prompts, paired with AR for S
(pipelines/eval/prompt_intervals.py), in the metrics, the table and the report files."""

from __future__ import annotations

import numpy as np
import pytest

from drelay_model.decoding import GenerationConfig
from drelay_model.decoding.stats import DecodeStats
from drelay_model.drafter import BlockDrafter, DrafterConfig
from drelay_model.selectors import NativeSelector
from pipelines.common.methods import MethodSpec
from pipelines.data.eval_sets import load_benchmark
from pipelines.eval.metrics import cell_metrics, method_metrics
from pipelines.eval.prompt_intervals import cell_intervals, mean_intervals, speedup_rows, tau_rows
from pipelines.eval.prompts import HashEncoder
from pipelines.eval.report import ComparisonTable, MethodRow, csv_rows, markdown_table
from pipelines.eval.results import CellResult, PassResult, PromptRecord, cell_store
from pipelines.eval.runner import EvalConfig, Evaluation, MethodUnderTest
from pipelines.eval.session import summarize


def _record(pid, turn, seed, *, tokens, seconds, rounds=None, committed=None, ar_tokens=None, ar_seconds=None):
    tau = committed / rounds if rounds else None
    return PromptRecord(pid, turn, seed, 4, tokens, "d", rounds=rounds, tau=tau, wall_s=seconds, ar_wall_s=ar_seconds,
                        ar_new_tokens=ar_tokens)  # fmt: skip


def _cell(bench, method, records) -> CellResult:
    """A cell whose passes are the sums of its records (as a pass at concurrency 1 is)."""
    passes = []
    for seed in sorted({r.seed for r in records}):
        mine = [r for r in records if r.seed == seed]
        committed = sum(round(r.tau * r.rounds) for r in mine if r.rounds)
        totals = DecodeStats(num_slots=4, generated=sum(r.new_tokens for r in mine), committed=committed,
                             rounds=sum(r.rounds or 0 for r in mine), time_total=sum(r.wall_s for r in mine))  # fmt: skip
        passes.append(PassResult(seed, 1, totals))
    return CellResult(bench, method, "fp", passes, list(records))


def _paired_cell(bench, rng, n=12, seeds=(0,), gain=1.3):
    """n prompts (the first has two turns), each timed with AR back to back under a shared slowdown."""
    records, ar_records = [], []
    for seed in seeds:
        for p in range(n):
            for turn in range(2 if p == 0 else 1):
                tokens, load = int(rng.integers(20, 60)), rng.lognormal(0, 0.3)
                ar_s = tokens / 30 * load
                rounds = int(rng.integers(tokens // 3, tokens))
                records.append(_record(f"p{p}", turn, seed, tokens=tokens, seconds=ar_s / gain * rng.lognormal(0, 0.05),
                                       rounds=rounds, committed=tokens - 1, ar_tokens=tokens, ar_seconds=ar_s))  # fmt: skip
                ar_records.append(
                    _record(f"p{p}", turn, seed, tokens=tokens, seconds=ar_s, rounds=tokens - 1, committed=tokens - 1)
                )
    return _cell(bench, "native", records), _cell(bench, "ar", ar_records)


def test_rows_sum_each_prompts_turns_per_seed():
    cell, ar = _paired_cell("mt_bench", np.random.default_rng(0), n=3, seeds=(0, 1))
    taus, speeds = tau_rows(cell), speedup_rows(cell, ar)
    assert taus.shape == (3, 4) and speeds.shape == (3, 8)  # 3 prompts × (2 seeds × columns)
    first = [r for r in cell.prompts if r.prompt_id == "p0" and r.seed == 1]
    assert len(first) == 2 and taus[0, 3] == sum(r.rounds for r in first)  # both turns of p0, seed 1
    assert speeds[0, 5] == pytest.approx(sum(r.wall_s for r in first))


def test_cell_intervals_bracket_the_cells_own_points_and_repeat_exactly():
    rng = np.random.default_rng(1)
    cell, ar = _paired_cell("gsm8k", rng, seeds=(0, 1))
    m = cell_metrics(cell, ar, (1,))
    # τ: mean over seeds of pooled τ, the passes' figure; S: mean over seeds of the pooled paired rate ratio
    assert m["tau_ci_low"] < m["tau"] < m["tau_ci_high"]
    assert m["speedup_ci_low"] < m["speedup"] < m["speedup_ci_high"] and m["speedup_ci_low"] > 1.0  # a 1.3× gain, resolved
    iv = cell_intervals(cell, ar)
    assert iv["tau"].point == pytest.approx(m["tau"]) and iv["speedup"].point == m["speedup"]
    assert cell_intervals(cell, ar) == iv  # same seed, same interval
    other = cell_intervals(cell, ar, resamples=500, seed=3)
    assert other["speedup"].point == iv["speedup"].point and other["speedup"].low != iv["speedup"].low


def test_the_pairing_with_ar_narrows_the_speedup_interval():
    """A shared per-prompt slowdown cancels in S only when each prompt's AR time stays with its method time."""
    cell, ar = _paired_cell("gsm8k", np.random.default_rng(2), n=16)
    paired = cell_intervals(cell, ar)["speedup"]
    rows = speedup_rows(cell, ar)
    rows[:, 2:] = rows[np.random.default_rng(0).permutation(len(rows)), 2:]  # AR's timings shuffled across prompts
    from pipelines.common.intervals import paired_bootstrap
    from pipelines.eval.prompt_intervals import seed_mean_speedup

    broken = paired_bootstrap([rows], lambda means: seed_mean_speedup(means[0]))
    assert broken.half_width > 2 * paired.half_width


def test_the_mean_over_benchmarks_resamples_every_benchmark_at_once():
    rng = np.random.default_rng(4)
    (a, ar_a), (b, ar_b) = _paired_cell("gsm8k", rng), _paired_cell("mbpp", rng, gain=1.1)
    b.benchmark = ar_b.benchmark = "mbpp"
    row = method_metrics([a, b], {"gsm8k": ar_a, "mbpp": ar_b}, (1,))
    for name in ("tau", "speedup"):
        assert row[f"mean_{name}"] == pytest.approx((row[f"gsm8k/{name}"] + row[f"mbpp/{name}"]) / 2)
        assert row[f"mean_{name}_ci_low"] < row[f"mean_{name}"] < row[f"mean_{name}_ci_high"]
    # averaging two benchmarks' independent noise: the mean's interval is narrower than the wider cell's
    widest = max(row[f"{x}/speedup_ci_high"] - row[f"{x}/speedup_ci_low"] for x in ("gsm8k", "mbpp"))
    assert row["mean_speedup_ci_high"] - row["mean_speedup_ci_low"] < widest
    assert set(mean_intervals([a, b], {"gsm8k": ar_a, "mbpp": ar_b}, ["tau"])) == {"mean_tau"}


def test_batched_prompts_have_no_tau_interval_and_phased_batches_no_speedup_interval():
    cell, ar = _paired_cell("gsm8k", np.random.default_rng(5))
    for r in cell.prompts:  # decoded in batches: a prompt's rounds are the batch's
        r.rounds = r.tau = r.ar_wall_s = r.ar_new_tokens = None
    assert tau_rows(cell) is None
    alone = cell_metrics(cell, ar, (1,))  # phased, one prompt at a time: AR's own cell pairs each prompt
    assert "tau_ci_low" not in alone and alone["speedup_ci_low"] < alone["speedup"] < alone["speedup_ci_high"]
    for p in cell.passes + ar.passes:  # phased in batches of 2: the prompts' seconds are their batches'
        p.concurrency = 2
    assert "speedup_ci_low" not in cell_metrics(cell, ar, (2,))


def test_table_and_csv_carry_the_intervals():
    metrics = {"gsm8k/speedup": 1.21, "gsm8k/speedup_ci_low": 1.15, "gsm8k/speedup_ci_high": 1.27, "gsm8k/tau": 1.5,
               "mean_speedup": 1.21, "mean_speedup_ci_low": 1.15, "mean_speedup_ci_high": 1.27, "mean_tau": 1.5}  # fmt: skip
    table = ComparisonTable(("gsm8k",), [MethodRow("native", metrics)])
    assert markdown_table(table).splitlines()[2] == "| native | 1.21× [1.15, 1.27] | 1.50 | 1.21× [1.15, 1.27] | 1.50 |"
    row = csv_rows(table)[0]
    assert row["gsm8k_S_ci_low"] == 1.15 and row["avg_S_ci_high"] == 1.27 and row["gsm8k_tau_ci_low"] is None


def test_a_resumed_evaluation_reports_the_same_intervals(tiny, data_dir, tmp_path):
    """Real decoding on the tiny target: every cell gets τ and S intervals, and a rerun that reads every
    cell back from disk writes the same summary, intervals included."""
    drafter = BlockDrafter(DrafterConfig.for_target(tiny, num_layers=1), tiny).eval()
    methods = {"ar": MethodUnderTest("ar"), "native": MethodUnderTest("native", drafter, NativeSelector(),
                                                                      spec=MethodSpec("native", random_drafter=True))}  # fmt: skip
    config = EvalConfig(target="tiny-llama", specs=(MethodSpec("ar"), MethodSpec("native", random_drafter=True)),
                        benchmarks=("gsm8k", "mt_bench"), decode=GenerationConfig(8), data_dir=str(data_dir),
                        verify_length="fixed", diagnostics=False)  # fmt: skip
    prompts = {b: load_benchmark(b, data_dir=data_dir) for b in config.benchmarks}
    out = tmp_path / "out"

    def evaluate():
        ev = Evaluation(config, tiny, methods, prompts, HashEncoder(tiny.vocab_size), cell_store(out), progress=False)
        return summarize(ev, ev.run(), out, "t", {"resamples": 300, "seed": 1})

    first = evaluate()
    native = first.method_metrics["native"]
    for name in ("gsm8k/tau", "gsm8k/speedup", "mt_bench/tau", "mt_bench/speedup", "mean_tau", "mean_speedup"):
        assert native[f"{name}_ci_low"] <= native[name] <= native[f"{name}_ci_high"], name
    assert "300 resamples, seed 1" in first.text and "× [" in first.text
    again = evaluate()  # every cell read back
    assert again.method_metrics == first.method_metrics
