"""The scripts in benchmarks/ (performance) and analysis/ answer bad input like `drelay` does: one line on stderr, exit 2."""

import math
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

BAD_INPUTS = [
    ("benchmarks/bench_selector.py", ["--checkpoint", "/nonexistent"], "checkpoint '/nonexistent' not found"),
    ("analysis/selector_decisions.py", ["--checkpoint", "/nonexistent"], "checkpoint '/nonexistent' not found"),
    (
        "analysis/trace_repairs.py",
        ["--checkpoint", "/nonexistent", "--cells", "/nonexistent"],
        "checkpoint '/nonexistent' not found",
    ),
    (
        "analysis/trace_repairs.py",
        ["--checkpoint", str(ROOT / "checkpoints/smollm2-135m"), "--cells", "/nonexistent"],
        "--cells: no '/nonexistent/gsm8k__ar.json'",
    ),
    ("benchmarks/bench_selectors.py", ["--trained", "dcoco"], "--trained dcoco: expected NAME=DIR"),
    ("benchmarks/bench_selectors.py", ["--rounds", "/nonexistent"], "--rounds /nonexistent: no such file"),
    ("benchmarks/bench_selectors.py", ["--rounds", "/nonexistent", "--batches", "1,x"], "--batches: expected integers"),
    ("benchmarks/bench_packed.py", ["--target", "nope"], "unknown target 'nope'"),
    ("benchmarks/bench_batcher.py", ["--methods", "nope"], "unknown method 'nope'"),
    ("benchmarks/bench_batcher.py", ["--concurrency", "0"], "--concurrency must be between 1 and --requests (48), got 0"),
    ("benchmarks/bench_batcher.py", ["--threads", "zero"], "threads must be a positive integer or auto, got 'zero'"),
    ("benchmarks/bench_batcher.py", ["--duty", "1.5"], "--duty: a share in (0, 1], got 1.5"),
    ("benchmarks/bench_batcher.py", ["--prefill-budget", "0"], "--prefill-budget: positive token counts or none, got 0"),
    ("analysis/budget_study.py", ["--hours", "0"], "--hours and --fit-from must be > 0"),
    ("analysis/ar_verify_agreement.py", ["--verify-lengths", "1,0"], "--verify-lengths: positive integers, got '1,0'"),
    ("analysis/ar_verify_agreement.py", ["--benchmarks", "gsm8k,nope"], "--benchmarks: unknown nope; valid: gsm8k"),
    ("analysis/partial_blocks.py", ["--compare-dir", "/nonexistent", "--lengths", "0,2"], "--lengths: each L in 1..14"),
    ("analysis/partial_blocks.py", ["--compare-dir", "/nonexistent"], "--compare-dir: no '/nonexistent/cells'"),
    (
        "analysis/partial_blocks.py",
        ["--compare-dir", "/nonexistent", "--methods", "dflash2"],
        "--methods: one or both of drelay, native",
    ),
]


def _run_as_main(script: Path, args: list[str], monkeypatch, capsys) -> tuple[object, str]:
    """`python SCRIPT ARGS` in this process (runpy with the argv and sys.path a script run by `python`
    gets; torch and the project are imported once for every script): its exit code and stderr.
    Anything but SystemExit propagates and fails the test, as a traceback would."""
    monkeypatch.setattr(sys, "argv", [str(script), *args])
    monkeypatch.syspath_prepend(str(script.parent))
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(script), run_name="__main__")
    return exit_.value.code, capsys.readouterr().err


@pytest.mark.parametrize("case", range(len(BAD_INPUTS)), ids=[f"{s}-{a[-1]}" for s, a, _ in BAD_INPUTS])
def test_bad_input_is_one_line_and_exit_2(case, monkeypatch, capsys):
    script, args, message = BAD_INPUTS[case]
    code, err = _run_as_main(ROOT / script, args, monkeypatch, capsys)
    assert code == 2, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"{Path(script).name}: error: ") and message in last
    assert "Traceback" not in err


def test_training_budget_names_a_missing_run_or_experiment(tmp_path, monkeypatch, capsys):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    script = ROOT / "analysis" / "plot_training_budget.py"
    args = ["--runs", "nope", "--out", str(tmp_path / "x.png")]
    code, err = _run_as_main(script, args, monkeypatch, capsys)
    assert code == 2 and "--experiment: no MLflow experiment 'drelay-train'" in err, err
    from pipelines.common.tracking import ensure_experiment, get_client

    ensure_experiment(get_client(uri), "drelay-train")
    code, err = _run_as_main(script, args, monkeypatch, capsys)
    assert code == 2 and "--runs: no finished MLflow run named 'nope'" in err, err
    assert not (tmp_path / "x.png").exists()


def test_training_budget_points_chain_wall_time():
    """x = minutes since the run's start + every earlier run's whole duration."""
    sys.path.insert(0, str(ROOT / "analysis"))
    from plot_training_budget import budget_points

    minute = 60_000
    first = (
        "a",
        0,
        10 * minute,
        {"val/tau_native": [(5, 4 * minute, 1.2), (10, 9 * minute, 1.4)], "val/tau_oracle": [(10, 9 * minute + 30_000, 2.5)]},
    )
    second = ("b", 50 * minute, 56 * minute, {"val/tau_native": [(3, 53 * minute, 1.5)]})
    points = budget_points([first, second])
    assert [(p.run, p.step, p.minutes) for p in points] == [("a", 5, 4.0), ("a", 10, 9.5), ("b", 3, 13.0)]
    assert points[1].tau == {"val/tau_native": 1.4, "val/tau_oracle": 2.5} and points[0].tau == {"val/tau_native": 1.2}


def test_the_batcher_benchmark_keeps_its_clients_in_flight_and_decodes_every_request():
    """`bench_batcher.closed_loop` on a tiny target: C requests in flight (never more), every request
    submitted and finished, and the tokens it counts are the ones the batcher committed."""
    import torch

    from drelay_model.decoding import GenerationConfig, SpeculativeEngine
    from drelay_model.decoding.batcher import ContinuousBatcher
    from drelay_model.target.loading import tiny_target

    closed_loop = runpy.run_path(str(ROOT / "benchmarks" / "bench_batcher.py"))["closed_loop"]
    target = tiny_target()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, target.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 3, 7, 4, 6, 8)]
    batcher = ContinuousBatcher(SpeculativeEngine(target), max_batch=3)
    seen = []
    step = batcher.step
    batcher.step = lambda: (seen.append(batcher.num_running + batcher.num_pending), step())[1]
    r = closed_loop(batcher, prompts, GenerationConfig(max_new_tokens=6), concurrency=3)
    assert max(seen) == 3 and batcher.stats.requests == len(prompts) and batcher.idle
    assert len(prompts) <= r["tokens"] == batcher.stats.generated <= 6 * len(prompts)
    assert r["rounds"] == batcher.stats.steps and r["wall_s"] > 0 and r["tok_s"] == r["tokens"] / r["wall_s"]
    assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"] and r["prefill_p50_s"] > 0 and r["queue_p99_s"] >= 0
    assert 0 < r["itl_p50_s"] <= r["itl_p99_s"] <= r["itl_max_s"] < r["wall_s"]


@pytest.mark.slow
def test_every_head_is_timed_on_recorded_rounds(tmp_path, monkeypatch, capsys):
    """bench_selectors.py --rounds: rounds recorded from real decoding (the committed fixture), every
    head and DRelay's reference path timed at each batch size, in one table."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import selector_rounds as sr

    import torch

    rounds = sr.read_fixture(ROOT / "tests/model/fixtures/drelay_rounds.pt")
    torch.save(rounds, tmp_path / "rounds.pt")
    monkeypatch.setattr(
        sys, "argv", ["bench_selectors.py", "--rounds", str(tmp_path / "rounds.pt"), "--batches", "1,2", "--reps", "1"]
    )
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(ROOT / "benchmarks/bench_selectors.py"), run_name="__main__")
    assert exit_.value.code == 0
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[2:4] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and not line.startswith("| selector")}  # fmt: skip
    assert set(rows) == {"drelay", "dcoco", "dflash2", "domino", "dspark", "drelay (reference)"}
    assert all(float(ms.rstrip(" |")) > 0 for cells in rows.values() for ms in cells)


def test_the_batcher_benchmark_pairs_its_ratios_by_repeat():
    """`bench_batcher.paired_ratios`: each arm ÷ its baseline per concurrency, the pooled rate and the
    mean TTFT p99, with bounds from 3 repeats and none below."""
    paired_ratios = runpy.run_path(str(ROOT / "benchmarks" / "bench_batcher.py"))["paired_ratios"]
    loop = lambda tokens, wall, p99: {"tokens": tokens, "wall_s": wall, "ttft_p99_s": p99}  # noqa: E731
    base = [loop(100, 10.0, 2.0), loop(100, 11.0, 2.2), loop(100, 9.0, 1.8)]
    faster = [loop(100, 5.0, 1.0), loop(100, 5.4, 1.1), loop(100, 4.6, 0.95)]
    r = paired_ratios({"ar/none": {16: base}, "ar/512": {16: faster}}, {"ar/none": "ar/none", "ar/512": "ar/none"})
    assert r["ar/none"][16]["tok_s"].point == pytest.approx(1.0)
    rate, ttft = r["ar/512"][16]["tok_s"], r["ar/512"][16]["ttft_p99"]
    assert rate.point == pytest.approx(300 / 15.0 / (300 / 30.0)) and 1.0 < rate.low <= rate.point <= rate.high
    assert ttft.point == pytest.approx(3.05 / 6.0) and ttft.high < 1.0
    two = paired_ratios({"a": {8: base[:2]}, "b": {8: faster[:2]}}, {"a": "a", "b": "a"})["b"][8]["tok_s"]
    assert two.point == pytest.approx(200 / 10.4 / (200 / 21.0)) and math.isnan(two.low)


def test_the_speedup_benchmark_pairs_its_ratios_by_prompt_within_benchmark():
    """`bench_speedup.paired_intervals`: each contender ÷ AR and DRelay ÷ native at the same length,
    the mean over benchmarks of the mean per-prompt ratio, with a stratified bootstrap interval."""
    paired_intervals = runpy.run_path(str(ROOT / "benchmarks" / "bench_speedup.py"))["paired_intervals"]
    names = ["ar", "native/cost", "drelay/cost"]
    seconds = {
        "gsm8k": {"ar": [2.0, 2.0, 2.0], "native/cost": [1.0, 1.0, 1.0], "drelay/cost": [0.5, 0.5, 0.5]},
        "mt_bench": {"ar": [3.0, 3.0, 3.0], "native/cost": [3.0, 2.0, 1.5], "drelay/cost": [3.0, 2.0, 1.5]},
    }
    iv = paired_intervals(seconds, names)
    assert set(iv) == {"native/cost ÷ ar", "drelay/cost ÷ ar", "drelay/cost ÷ native/cost"}
    native = iv["native/cost ÷ ar"]
    assert native.point == pytest.approx((2.0 + (1.0 + 1.5 + 2.0) / 3) / 2) and native.low < native.point < native.high
    relay = iv["drelay/cost ÷ native/cost"]  # paired: ×2 on every GSM8K prompt, ×1 on every MT-Bench one
    assert relay.point == pytest.approx(1.5) and relay.low == pytest.approx(1.5) and relay.high == pytest.approx(1.5)
    one_each = {b: {n: s[:1] for n, s in per.items()} for b, per in seconds.items()}
    assert paired_intervals(one_each, names) == {}  # one prompt per benchmark: no spread, no interval


def test_ar_and_verification_blocks_choose_the_same_tokens(monkeypatch, capsys):
    """The real target's greedy tokens are the same read one per forward (AR) and in verification
    blocks; the script prints one row per block size."""
    script = ROOT / "analysis" / "ar_verify_agreement.py"
    monkeypatch.setattr(
        sys,
        "argv",
        [str(script), "--benchmarks", "gsm8k", "--prompts", "1", "--max-new-tokens", "12", "--verify-lengths", "2,15"],
    )
    monkeypatch.syspath_prepend(str(script.parent))
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(script), run_name="__main__")
    assert exit_.value.code == 0
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 + ")]
    assert [r[1].strip() for r in rows] == ["1 + 2", "1 + 15"]
    for r in rows:
        assert int(r[2]) == 12 and float(r[3]) < 1e-3 and int(r[4]) == 0  # positions, max |Δ|, disagreements
