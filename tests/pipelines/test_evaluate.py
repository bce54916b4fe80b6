"""`drelay eval`: τ/S bookkeeping, the evaluation core on tiny targets, resume, MLflow layout, bad input."""

from __future__ import annotations

import statistics

import pytest
import torch

from drelay_model.decoding import GenerationConfig
from drelay_model.decoding.stats import DecodeStats
from drelay_model.drafter import BlockDrafter, DrafterConfig
from drelay_model.selectors import NativeSelector
from pipelines.data.eval_sets import load_benchmark
from cli import main
from pipelines.eval.metrics import cell_metrics, method_metrics
from pipelines.eval.prompts import HashEncoder
from pipelines.common.methods import MethodSpec
from pipelines.eval.results import CellResult, PassResult, cell_store
from pipelines.eval.runner import EvalConfig, Evaluation, MethodUnderTest, output_digest
from pipelines.common.tracking import get_client

# ---- fixtures (`tiny`, `data_dir`: tests/pipelines/conftest.py) ------------------------------------


def _methods(target, top_k: int = 16) -> dict[str, MethodUnderTest]:
    torch.manual_seed(0)
    drafter = BlockDrafter(DrafterConfig.for_target(target, num_layers=1, top_k=top_k), target).eval()
    native = MethodUnderTest("native", drafter, NativeSelector(), spec=MethodSpec("native", random_drafter=True))
    return {"ar": MethodUnderTest("ar"), "native": native}


def _evaluation(target, data_dir, out, *, top_k=16, encoder=None, max_new_tokens=10, temperature=0.0, **overrides) -> Evaluation:
    settings = dict(target="tiny-llama", specs=(MethodSpec("ar"), MethodSpec("native", random_drafter=True)), benchmarks=("gsm8k", "mt_bench"),
                    decode=GenerationConfig(max_new_tokens, temperature), limit=2, data_dir=str(data_dir), verify_length="fixed")  # fmt: skip
    config = EvalConfig(**{**settings, **overrides})
    prompts = {b: load_benchmark(b, limit=config.limit, data_dir=data_dir) for b in config.benchmarks}
    enc = encoder or HashEncoder(target.vocab_size)
    return Evaluation(config, target, _methods(target, top_k), prompts, enc, cell_store(out), progress=False)


# ---- bookkeeping against hand-computed rounds --------------------------------------------------------


def test_tau_and_slot_acceptance_from_hand_computed_rounds():
    stats = DecodeStats(num_slots=4)
    stats.record_round([0, 2, 4], [1, 3, 5])  # three rounds: 1 + 3 + 5 tokens
    stats.steps, stats.generated = 3, 10  # + 1 prefill token
    stats.time_prefill, stats.time_draft, stats.time_verify, stats.time_total = 0.1, 0.3, 0.6, 1.3
    stats.requests = 1
    totals = DecodeStats.merged([stats, stats])
    assert totals.tau == pytest.approx(9 / 3) and totals.requests == 2
    assert totals.slot_acceptance == pytest.approx([2 / 3, 2 / 3, 1 / 3, 1 / 3])
    assert totals.breakdown_ms_per_step() == pytest.approx({"draft": 100.0, "select": 0.0, "verify": 200.0, "other": 100.0})
    assert totals.ms_prefill == pytest.approx(100.0) and totals.tokens_per_second == pytest.approx(20 / 2.6)
    merged = totals + totals
    assert merged.accept_hist.tolist() == [2 * a for a in totals.accept_hist.tolist()] and merged.tau == totals.tau
    assert DecodeStats.from_dict(merged.to_dict()).to_dict() == merged.to_dict()  # JSON round trip


def _cell(bench, method, runs: dict[tuple[int, int], tuple[int, float, int, int]]) -> CellResult:
    """runs: (seed, concurrency) → (generated tokens, seconds, committed, rounds)."""
    passes = []
    for (seed, conc), (gen, secs, committed, rounds) in runs.items():
        t = DecodeStats(num_slots=4, generated=gen, committed=committed, rounds=rounds, steps=rounds, requests=1, time_total=secs)
        passes.append(PassResult(seed, conc, t))
    return CellResult(bench, method, "fp", passes, [])


def test_speedup_is_the_tokens_per_second_ratio_per_seed():
    ar = _cell("gsm8k", "ar", {(0, 1): (100, 10.0, 99, 99), (1, 1): (100, 20.0, 99, 99), (0, 4): (100, 2.0, 99, 99)})
    m = _cell("gsm8k", "native", {(0, 1): (100, 4.0, 99, 33), (1, 1): (100, 5.0, 99, 45), (0, 4): (100, 1.0, 99, 33)})
    got = cell_metrics(m, ar, (1, 4))
    assert got["speedup"] == pytest.approx(statistics.fmean([2.5, 4.0]))
    assert got["speedup_std"] == pytest.approx(statistics.stdev([2.5, 4.0]))
    assert got["tau"] == pytest.approx(statistics.fmean([3.0, 2.2])) and got["tau_std"] > 0
    assert got["speedup/c4"] == pytest.approx(2.0) and got["throughput/c4"] == pytest.approx(100.0)
    assert cell_metrics(ar, ar, (1, 4))["speedup"] == 1.0
    ar2 = _cell("mbpp", "ar", {(0, 1): (50, 10.0, 49, 49), (1, 1): (50, 10.0, 49, 49), (0, 4): (50, 1.0, 49, 49)})
    m2 = _cell("mbpp", "native", {(0, 1): (50, 5.0, 49, 49), (1, 1): (50, 5.0, 49, 49), (0, 4): (50, 1.0, 49, 49)})
    row = method_metrics([m, m2], {"gsm8k": ar, "mbpp": ar2}, (1, 4))
    assert row["gsm8k/speedup"] == pytest.approx(3.25) and row["mbpp/speedup"] == pytest.approx(2.0)
    assert row["mean_speedup"] == pytest.approx((3.25 + 2.0) / 2)  # arithmetic mean over benchmarks
    assert row["speedup/c4"] == pytest.approx((150 / 2.0) / (150 / 3.0))  # pooled tokens/s ratio


def test_paired_speedup_is_the_pooled_rate_ratio_with_its_interval():
    from pipelines.eval.results import PromptRecord

    ar = _cell("gsm8k", "ar", {(0, 1): (100, 10.0, 99, 99)})
    m = _cell("gsm8k", "native", {(0, 1): (100, 2.0, 99, 33)})  # phased: S = 5
    # per prompt-turn: (tokens, seconds) for the method and its back-to-back AR run
    pairs = [(10, 1.0, 10, 1.5), (10, 1.0, 10, 1.0), (20, 1.0, 20, 3.0), (10, 2.0, 10, 1.0), (5, 1.0, 5, 1.2)]
    m.prompts = [
        PromptRecord(f"p{i}", 0, 0, 4, n, "d", wall_s=t, ar_wall_s=ta, ar_new_tokens=na) for i, (n, t, na, ta) in enumerate(pairs)
    ]
    m.other_cpu_share = 0.25
    got = cell_metrics(m, ar, (1,))
    pooled = (55 / 6.0) / (55 / 7.7)  # Σ tokens ÷ Σ seconds, the method's over AR's
    assert got["speedup"] == pytest.approx(pooled) and got["speedup_phased"] == pytest.approx(5.0)
    assert got["speedup_ci_low"] < pooled < got["speedup_ci_high"]
    assert "tau_ci_low" not in got  # these records carry no rounds
    assert got["other_cpu_share"] == 0.25


# ---- the evaluation core on a tiny target ------------------------------------------------------------


def test_greedy_cells_agree_with_ar_and_replay(tiny, data_dir, tmp_path):
    ev = _evaluation(tiny, data_dir, tmp_path / "out", top_k=tiny.vocab_size, concurrency=(1, 2), max_new_tokens=40)
    cells = ev.run()
    assert set(cells) == {(b, m) for b in ("gsm8k", "mt_bench") for m in ("ar", "native")}
    for bench in ("gsm8k", "mt_bench"):
        ar, nat = cells[(bench, "ar")], cells[(bench, "native")]
        m = cell_metrics(nat, ar, (1, 2))
        assert m["matches_ar"] == 1.0 and m["tau_replay"] == m["tau"] and m["tau_replay_gap"] == 0.0
        assert m["oracle_tau"] > m["tau"] and m["efficiency"] < 1
        # A pool holding the whole vocabulary always covers the target's token.
        assert nat.replay.diagnostics.served_errors > 0 and m["coverage_first_error"] == 1.0 and m["one_edit_gain"] >= 1
        assert sorted((p.seed, p.concurrency) for p in nat.passes) == [(0, 1), (0, 2)]
        assert set(ar.outputs) == {p.prompt_id for p in ar.prompts}
        assert all(r.tau_replay == pytest.approx(r.tau) for r in nat.prompts)
    turns = sorted((r.prompt_id, r.turn) for r in cells[("mt_bench", "ar")].prompts)
    assert turns == [("81", 0), ("81", 1), ("82", 0), ("82", 1)]
    assert (tmp_path / "out" / "cells" / "mt_bench__native.json").is_file()


def test_cost_aware_cells_decode_as_ar_and_are_kept_apart_from_fixed_ones(tiny, data_dir, tmp_path):
    """`verify_length="cost"` (the default) builds the engines through the factory with a measured
    cost curve: outputs stay AR's, and its cells never resume from fixed-length ones."""
    out = tmp_path / "out"
    fixed = _evaluation(tiny, data_dir, out, benchmarks=("gsm8k",), diagnostics=False).run()
    ev = _evaluation(tiny, data_dir, out, benchmarks=("gsm8k",), diagnostics=False, verify_length="cost")
    assert ev.config.as_params()["verify_length"] == "cost" and EvalConfig.__dataclass_fields__["verify_length"].default == "cost"
    assert ev.fingerprint("gsm8k", "native") != fixed[("gsm8k", "native")].fingerprint
    assert ev.fingerprint("gsm8k", "ar") == fixed[("gsm8k", "ar")].fingerprint  # AR decodes the same either way
    engine = ev.methods["native"].engine(tiny, "cost", target_spec="tiny-llama")
    assert engine.costs is not None and engine.policy is not None
    cells = ev.run()
    digests = {name: [r.output_digest for r in cells[("gsm8k", name)].prompts] for name in ("ar", "native")}
    assert digests["native"] == digests["ar"]


def test_paired_timing_is_immune_to_load_during_the_ar_phase(tiny, data_dir, tmp_path, monkeypatch):
    """Another process busy only while AR's own cell runs (a sleep in every target forward) inflates
    phased S; paired S, timed against AR on the same prompts back to back, does not move."""
    import time as _time

    ev = _evaluation(tiny, data_dir, tmp_path / "out", benchmarks=("gsm8k",), max_new_tokens=12)
    busy = {"on": False}
    forward = type(tiny).forward

    def slow_forward(self, *args, **kwargs):
        if busy["on"]:
            _time.sleep(0.01)
        return forward(self, *args, **kwargs)

    run_cell = Evaluation.run_cell

    def ar_phase_is_busy(self, bench, name, fp, *, ar_cell):
        busy["on"] = name == "ar"
        try:
            return run_cell(self, bench, name, fp, ar_cell=ar_cell)
        finally:
            busy["on"] = False

    monkeypatch.setattr(type(tiny), "forward", slow_forward)
    monkeypatch.setattr(Evaluation, "run_cell", ar_phase_is_busy)
    cells = ev.run()
    nat, ar = cells[("gsm8k", "native")], cells[("gsm8k", "ar")]
    assert all(r.ar_wall_s and r.ar_new_tokens == r.new_tokens for r in nat.prompts)  # greedy: the same tokens
    assert all(r.ar_wall_s is None for r in ar.prompts)
    m = cell_metrics(nat, ar, (1,))
    assert m["speedup_phased"] > 2 * m["speedup"]
    assert 0.0 <= m["other_cpu_share"] <= 1.0


class RecordingEncoder(HashEncoder):
    def __init__(self, vocab):
        super().__init__(vocab)
        self.calls: list[tuple[tuple[str, ...], list[list[int]]]] = []

    def encode(self, turns, answers):
        self.calls.append((tuple(turns), [list(a) for a in answers]))
        return super().encode(turns, answers)


def test_second_turn_is_conditioned_on_the_models_own_first_answer(tiny, data_dir, tmp_path):
    enc = RecordingEncoder(tiny.vocab_size)
    ev = _evaluation(tiny, data_dir, tmp_path / "out", encoder=enc, benchmarks=("mt_bench",), temperature=1.0, seeds=(0, 1))
    cells = ev.run()
    for cell in cells.values():
        first = {(r.prompt_id, r.seed): r.output_digest for r in cell.prompts if r.turn == 0}
        assert len(first) == 4  # 2 conversations × 2 seeds
    second_turn_answers = {output_digest(answers[0]) for turns, answers in enc.calls if len(turns) == 2}
    own_first = {r.output_digest for c in cells.values() for r in c.prompts if r.turn == 0}
    assert second_turn_answers == own_first  # every turn-2 prompt carried a turn-1 output, and vice versa
    m = cell_metrics(cells[("mt_bench", "native")], cells[("mt_bench", "ar")], (1,))
    assert "tau_std" in m and "tau_replay" not in m  # sampling: mean ± std over seeds, no greedy replay


def test_resume_skips_finished_cells(tiny, data_dir, tmp_path, monkeypatch):
    out = tmp_path / "out"
    first = _evaluation(tiny, data_dir, out).run()
    calls = []
    original = Evaluation.run_cell

    def counting(self, bench, name, fp, *, ar_cell):
        calls.append((bench, name))
        return original(self, bench, name, fp, ar_cell=ar_cell)

    monkeypatch.setattr(Evaluation, "run_cell", counting)
    loaded = []
    again = _evaluation(tiny, data_dir, out).run(on_cell=lambda cell, was_loaded: loaded.append(was_loaded))
    assert calls == [] and loaded == [True] * 4
    assert again[("gsm8k", "native")].to_dict() == first[("gsm8k", "native")].to_dict()
    cell_store(out).path("mt_bench", "native").unlink()
    _evaluation(tiny, data_dir, out).run()
    assert calls == [("mt_bench", "native")]
    calls.clear()
    _evaluation(tiny, data_dir, out, max_new_tokens=6).run()  # other settings: nothing is reused
    assert len(calls) == 4


# ---- the command: MLflow layout, interruption, bad input -----------------------------------------------


def _cli(capsys, *argv):
    rc = main(["eval", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _tiny_args(data_dir, out, *extra):
    return ["--target", "tiny-llama", "--random-drafter", "--data-dir", str(data_dir), "--benchmarks", "gsm8k,mt_bench",
            "--limit", "1", "--max-new-tokens", "6", "--no-progress", "--out", str(out), "--run-name", "t", "--verify-length", "fixed", *extra]  # fmt: skip


def _runs(client, status=None):
    exp = client.get_experiment_by_name("drelay-eval")
    if exp is None:
        return []
    runs = client.search_runs([exp.experiment_id])
    return [r for r in runs if status is None or r.info.status == status]


def test_mlflow_layout_of_an_evaluation(uri, data_dir, tmp_path, capsys):
    rc, out, err = _cli(capsys, *_tiny_args(data_dir, tmp_path / "out", "--concurrency", "1,2"))
    assert rc == 0, err
    assert "| native |" in out and "GSM8K S" in out
    client = get_client()
    runs = _runs(client)
    assert {r.info.status for r in runs} == {"FINISHED"}
    by_level = {lvl: [r for r in runs if r.data.tags.get("drelay.level") == lvl] for lvl in ("evaluation", "method", "cell")}
    (parent,) = by_level["evaluation"]
    tags = parent.data.tags
    assert parent.info.run_name == "t" and tags["drelay.methods"] == "ar,native" and tags["drelay.checkpoint"] == "random"
    assert parent.data.params["verify_length"] == "fixed" and parent.data.params["max_new_tokens"] == "6"
    assert tags["drelay.target"] == "tiny-llama" and tags["drelay.hardware"] and tags["drelay.git_commit"]
    methods = {r.info.run_name: r for r in by_level["method"]}
    assert set(methods) == {"ar", "native"}
    assert all(r.data.tags["mlflow.parentRunId"] == parent.info.run_id for r in methods.values())
    native = methods["native"].data.metrics
    for name in ("gsm8k/tau", "gsm8k/speedup", "mt_bench/tau", "mt_bench/speedup", "mean_tau", "mean_speedup",
                 "gsm8k/tau_replay", "gsm8k/oracle_tau", "gsm8k/efficiency", "gsm8k/coverage_first_error",
                 "slot_acceptance/01", "ms_draft", "ms_select", "ms_verify", "ms_other", "throughput/c2"):  # fmt: skip
        assert name in native, name
    assert native["gsm8k/tau"] == native["gsm8k/tau_replay"]
    cells = {r.info.run_name: r for r in by_level["cell"]}
    assert set(cells) == {"gsm8k/ar", "gsm8k/native", "mt_bench/ar", "mt_bench/native"}
    cell = cells["gsm8k/native"]
    assert cell.data.tags["mlflow.parentRunId"] == methods["native"].info.run_id
    assert {"tau", "speedup", "tau_replay", "oracle_tau", "slot_acceptance"} <= set(cell.data.metrics)
    for name in ("tau", "speedup"):  # 95% intervals beside each, in every run that logs the metric
        assert cell.data.metrics[f"{name}_ci_low"] <= cell.data.metrics[name] <= cell.data.metrics[f"{name}_ci_high"]
        assert native[f"gsm8k/{name}_ci_low"] == cell.data.metrics[f"{name}_ci_low"]
        assert native[f"mean_{name}_ci_low"] <= native[f"mean_{name}"] <= native[f"mean_{name}_ci_high"]
        assert parent.data.metrics[f"native/mean_{name}_ci_high"] == native[f"mean_{name}_ci_high"] == native[f"{name}_ci_high"]
    assert parent.data.params["bootstrap_resamples"] == "2000" and parent.data.params["bootstrap_seed"] == "0"
    assert {"prompts.json", "prompts", "cells"} <= {f.path for f in client.list_artifacts(cell.info.run_id)}
    assert parent.data.metrics["native/mean_tau"] == native["mean_tau"]
    plots = {f.path for f in client.list_artifacts(parent.info.run_id, "plots")}
    assert plots == {f"plots/{n}.png" for n in ("tau_speedup", "slot_acceptance", "latency", "throughput")}
    assert all((tmp_path / "out" / "plots" / f"{n}.png").stat().st_size > 0 for n in ("tau_speedup", "latency"))
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| Method | GSM8K S | GSM8K τ | MT-Bench S | MT-Bench τ | Avg. S | Avg. τ |" in report


def test_interrupted_evaluation_leaves_no_running_run_and_resumes(uri, data_dir, tmp_path, capsys, monkeypatch):
    original, calls = Evaluation.run_cell, []

    def interrupt_second(self, *a, **k):
        calls.append(a[:2])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return original(self, *a, **k)

    monkeypatch.setattr(Evaluation, "run_cell", interrupt_second)
    rc, _, err = _cli(capsys, *_tiny_args(data_dir, tmp_path / "out"))
    assert rc == 130 and "interrupted" in err
    client = get_client()
    assert _runs(client, "RUNNING") == []
    # Interrupted while computing gsm8k/native: the parent and the open method run 'ar' end FAILED;
    # the finished cell gsm8k/ar was logged and closed.
    assert sorted(r.info.run_name for r in _runs(client, "FAILED")) == ["ar", "t"]
    assert [r.info.run_name for r in _runs(client, "FINISHED")] == ["gsm8k/ar"]
    monkeypatch.setattr(Evaluation, "run_cell", original)
    rc, _, err = _cli(capsys, *_tiny_args(data_dir, tmp_path / "out"))
    assert rc == 0, err
    finished = [r for r in _runs(client, "FINISHED") if r.data.tags.get("drelay.level") == "evaluation"]
    assert len(finished) == 1 and finished[0].data.tags["drelay.resumed_cells"] == "1"
    assert _runs(client, "RUNNING") == []


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--benchmarks", "gsm8k,nope"], "unknown benchmark 'nope'"),
        (["--methods", "ar,magic"], "unknown method 'magic'"),
        (["--checkpoint", "/no/such/dir"], "checkpoint '/no/such/dir' not found"),
        (["--checkpoint", "magic=/tmp"], "'magic' is not a speculative method"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be"),
        (["--concurrency", "0"], "--concurrency: values must be ≥ 1"),
        (["--seeds", "a,b"], "--seeds: expected integers"),
        (["--max-new-tokens", "1000"], "leaves room for at most"),
        (["--run-name", "it's"], "must not contain quotes"),
        (["--bootstrap-resamples", "99"], "--bootstrap-resamples must be ≥ 100, got 99"),
    ],
)
def test_bad_input_is_one_line_and_starts_no_run(uri, data_dir, tmp_path, capsys, extra, message):
    args = (
        [a for a in _tiny_args(data_dir, tmp_path / "out") if a != "--random-drafter"]
        if "--checkpoint" in extra
        else _tiny_args(data_dir, tmp_path / "out")
    )
    rc, _, err = _cli(capsys, *args, *extra)
    assert rc == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert _runs(get_client()) == []


def test_missing_checkpoint_without_random_drafter(uri, data_dir, tmp_path, capsys):
    args = [a for a in _tiny_args(data_dir, tmp_path / "out") if a != "--random-drafter"]
    rc, _, err = _cli(capsys, *args)
    assert rc == 2 and "needs a drafter checkpoint" in err and err.count("\n") == 1


def test_empty_prompt_file_is_a_clear_error(uri, tmp_path, capsys):
    (tmp_path / "empty" / "gsm8k").mkdir(parents=True)
    (tmp_path / "empty" / "gsm8k" / "test.jsonl").write_text("")
    rc, _, err = _cli(capsys, *_tiny_args(tmp_path / "empty", tmp_path / "out"), "--benchmarks", "gsm8k")
    assert rc == 2 and "no gsm8k prompts in" in err and err.count("\n") == 1
    assert _runs(get_client(), "RUNNING") == [] and _runs(get_client()) == []
