"""`drelay compare`'s intervals: every ratio to the baseline with its 95% paired-bootstrap interval in the
table, compare.md, compare.json, the plot and MLflow; identical variants stay unresolved; a resumed
compare gives the same intervals; heads installed beside a checkpoint serve compare, eval and study."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from cli import main
from drelay_model.diagnostics import PoolDiagnostics
from drelay_model.drafter import BlockDrafter, DrafterConfig, save_drafter
from drelay_model.drafter.heads import add_head, head_path, read_head
from drelay_model.errors import DRelayError
from drelay_model.selectors import default_registry
from pipelines.common.intervals import UNRESOLVED
from pipelines.common.methods import resolve_method
from pipelines.common.tracking import get_client
from pipelines.eval import compare
from pipelines.eval.compare import parse_variants
from pipelines.eval.compare_intervals import Bootstrap, compare_intervals, headroom
from pipelines.eval.results import ReplayResult

ROOT = Path(__file__).resolve().parents[2]
INTERVAL = re.compile(r"\d+\.\d{3} \[\d+\.\d{3}, \d+\.\d{3}\]")


def _drafter(tiny, seed: int) -> BlockDrafter:
    torch.manual_seed(seed)
    return BlockDrafter(DrafterConfig.for_target(tiny, num_layers=1, top_k=8), tiny)


def _with_selector(drafter, path: Path, name: str, seed: int) -> Path:
    torch.manual_seed(seed)
    config = {"d_sel": 32, "read_dim": 32, "history_len": 8} if name == "drelay" else None
    sel = default_registry().create(name, drafter=drafter, config=config)
    extra = {f"selector.{k}": v for k, v in sel.state_dict().items()}
    return save_drafter(drafter, path, extra_tensors=extra, meta={"selector": {"name": name, "config": sel.config.to_dict()}})


@pytest.fixture
def checkpoints(tiny, tmp_path) -> tuple[Path, Path]:
    """(a native drafter, another drafter saved with a freshly initialised DRelay selector)."""
    save_drafter(_drafter(tiny, 0), tmp_path / "a")
    return tmp_path / "a", _with_selector(_drafter(tiny, 1), tmp_path / "b", "drelay", 1)


def _args(data_dir, out, variants, *extra):
    args = ["compare", "--target", "tiny-llama", "--data-dir", str(data_dir), "--benchmarks", "gsm8k,mt_bench", "--limit", "2",
            "--max-new-tokens", "12", "--no-progress", "--out", str(out), "--run-name", "cmp", *extra]  # fmt: skip
    for v in variants:
        args += ["--variant", v]
    return args


def test_intervals_everywhere_identical_variants_unresolved_and_resume_keeps_them(
    tiny, uri, data_dir, checkpoints, tmp_path, capsys, monkeypatch
):
    a, b = checkpoints
    out = tmp_path / "out"
    variants = [f"native={a}", f"twin={a}", f"drelay={b}"]
    assert main(_args(data_dir, out, variants)) == 0
    printed = capsys.readouterr().out
    doc = json.loads((out / "compare.json").read_text())
    m, benches = doc["metrics"], ("gsm8k", "mt_bench")

    # Every ratio but the baseline's carries its interval, around the table's own point estimate.
    for label in ("twin", "drelay"):
        for key in [f"{b}/ratio_vs_baseline" for b in benches] + ["ratio_vs_baseline", "headroom_share"]:
            low, point, high = m[label][f"{key}_ci_low"], m[label][key], m[label][f"{key}_ci_high"]
            assert low <= point <= high, (label, key)
        assert m[label]["ratio_vs_baseline"] == m[label]["mean_tau"] / m["native"]["mean_tau"]
        for bench in benches:
            assert m[label][f"{bench}/ratio_vs_baseline"] == m[label][f"{bench}/tau"] / m["native"][f"{bench}/tau"]
    assert "ratio_vs_baseline_ci_low" not in m["native"]
    # Identical variants: every interval contains 1 (the ratio is 1 in every resample), verdict unresolved.
    for key in [f"{b}/ratio_vs_baseline" for b in benches] + ["ratio_vs_baseline"]:
        assert m["twin"][f"{key}_ci_low"] == m["twin"][f"{key}_ci_high"] == 1.0
    assert doc["verdicts"]["twin"] == UNRESOLVED and set(doc["verdicts"]) == {"twin", "drelay"}
    assert doc["bootstrap"] == {"resamples": 2000, "seed": 0, "level": 0.95}
    power = doc["power"]["drelay"]
    assert set(power["per_benchmark"]) == set(benches) and power["prompts_per_benchmark"] == {"gsm8k": 2, "mt_bench": 2}

    # The printed table = compare.md: an interval in every ratio cell, the verdict table, the power lines.
    md = (out / "compare.md").read_text()
    assert md.strip() in printed
    ratio_rows = [line for line in md.splitlines() if line.startswith(("| GSM8K", "| MT-Bench", "| **mean**"))]
    assert len(ratio_rows) == 3 and all(len(INTERVAL.findall(row)) == 2 for row in ratio_rows)
    assert re.search(r"\| twin \| 1\.000 \[1\.000, 1\.000\] \| 0\.0% \[0\.0%, 0\.0%\] \| unresolved \|", md)
    assert "half-width of the mean ratio ±0.000 (GSM8K ±0.000, MT-Bench ±0.000)" in md
    assert "2000 resamples, seed 0" in md
    assert (out / "compare.png").stat().st_size > 0

    # MLflow: `<metric>_ci_low` / `_ci_high` beside each ratio, the verdict as a tag.
    client = get_client()
    run = client.search_runs([client.get_experiment_by_name("drelay-compare").experiment_id])[0]
    logged = run.data.metrics
    for key in ("ratio_vs_baseline", "gsm8k/ratio_vs_baseline", "headroom_share"):
        assert logged[f"drelay/{key}_ci_low"] == pytest.approx(m["drelay"][f"{key}_ci_low"])
        assert logged[f"drelay/{key}_ci_high"] == pytest.approx(m["drelay"][f"{key}_ci_high"])
    assert run.data.tags["verdict.twin"] == UNRESOLVED and run.data.params["bootstrap_resamples"] == "2000"

    # Rerun: every cell is loaded, nothing is replayed, and the intervals do not move.
    def boom(*args, **kwargs):
        raise AssertionError("a finished cell was recomputed")

    monkeypatch.setattr(compare, "replay_cell", boom)
    monkeypatch.setattr("pipelines.eval.runner.decode_pass", boom)
    assert main(_args(data_dir, out, variants, "--no-mlflow")) == 0
    again = json.loads((out / "compare.json").read_text())
    untimed = lambda metrics: {v: {k: x for k, x in row.items() if k != "select_ms"} for v, row in metrics.items()}  # noqa: E731
    assert untimed(again["metrics"]) == untimed(m) and again["power"] == doc["power"]
    capsys.readouterr()

    # Another bootstrap seed and count: same points, the settings recorded.
    assert main(_args(data_dir, out, variants, "--no-mlflow", "--bootstrap-resamples", "500", "--bootstrap-seed", "7")) == 0
    other = json.loads((out / "compare.json").read_text())
    assert other["bootstrap"] == {"resamples": 500, "seed": 7, "level": 0.95}
    assert other["metrics"]["drelay"]["ratio_vs_baseline"] == m["drelay"]["ratio_vs_baseline"]
    assert "500 resamples, seed 7" in capsys.readouterr().out


def test_a_replay_cell_without_per_prompt_counts_is_replayed_again(tiny, data_dir, checkpoints, tmp_path, monkeypatch):
    """Cells written before the per-prompt counts existed are replayed (the AR reference is kept)."""
    a, _ = checkpoints
    out = tmp_path / "out"
    args = ["compare", "--target", "tiny-llama", "--data-dir", str(data_dir), "--benchmarks", "gsm8k", "--limit", "2",
            "--max-new-tokens", "8", "--no-progress", "--no-mlflow", "--out", str(out), "--variant", f"x={a}"]  # fmt: skip
    assert main(args) == 0
    cell = out / "replay" / "gsm8k__x.json"
    doc = json.loads(cell.read_text())
    counts = np.array(list(doc["replay"]["per_prompt"].values())).sum(axis=0).tolist()
    r = dict(doc["replay"])
    assert counts == [r["rounds"], r["committed"], r["oracle_rounds"], r["oracle_committed"]]  # they sum to the totals
    del doc["replay"]["per_prompt"]
    cell.write_text(json.dumps(doc))
    calls = []
    replay_cell = compare.replay_cell
    monkeypatch.setattr(compare, "replay_cell", lambda *a, **k: calls.append(1) or replay_cell(*a, **k))
    monkeypatch.setattr("pipelines.eval.runner.decode_pass", lambda *a, **k: pytest.fail("the AR cell was decoded again"))
    assert main(args) == 0
    assert calls == [1] and json.loads(cell.read_text())["replay"]["per_prompt"] == r["per_prompt"]


def _replay(per_prompt: dict[str, list[int]]) -> ReplayResult:
    totals = np.array(list(per_prompt.values())).sum(axis=0).tolist()
    return ReplayResult(*totals, diagnostics=PoolDiagnostics(), per_prompt=per_prompt)


def _points(replays, label, benches):
    tau = lambda r: r.committed / r.rounds  # noqa: E731
    base = {b: tau(replays[(b, "base")]) for b in benches}
    own = {b: tau(replays[(b, label)]) for b in benches}
    mean, mean_base = sum(own.values()) / len(benches), sum(base.values()) / len(benches)
    oracle = sum(r.oracle_committed / r.oracle_rounds for (b, lbl), r in replays.items() if lbl == "base") / len(benches)
    return {**{f"{b}/ratio_vs_baseline": own[b] / base[b] for b in benches}, "ratio_vs_baseline": mean / mean_base,
            "headroom_share": headroom(mean, mean_base, oracle)}  # fmt: skip


def test_the_bootstrap_resamples_prompts_and_sizes_the_next_comparison():
    """Synthetic per-prompt counts: a variant that needs fewer rounds on every prompt is ahead, with a
    point estimate equal to the ratio of totals; the power line scales the half-width by 1/sqrt(n)."""
    rng = np.random.default_rng(0)
    benches, replays = ("b1", "b2"), {}
    for b in benches:
        base, fast = {}, {}
        for i in range(12):
            committed, rounds = int(rng.integers(40, 120)), int(rng.integers(20, 40))
            base[f"p{i}#0"] = [rounds, committed, rounds // 2, committed]
            fast[f"p{i}#0"] = [rounds - int(rng.integers(1, 5)), committed, rounds // 2, committed]
        replays |= {(b, "base"): _replay(base), (b, "fast"): _replay(fast)}
    points = {"fast": _points(replays, "fast", benches)}
    iv = compare_intervals(replays, ["base", "fast"], benches, "base", points, Bootstrap(1000, 0))["fast"]
    assert iv.mean_ratio.point == points["fast"]["ratio_vs_baseline"] and iv.verdict == "ahead"
    assert 1.0 < iv.mean_ratio.low < iv.mean_ratio.point < iv.mean_ratio.high
    assert all(x.low > 1.0 for x in iv.per_benchmark.values()) and 0 < iv.headroom_share.low < iv.headroom_share.high < 1
    h = iv.mean_ratio.half_width
    assert iv.prompts_to_resolve(0.02) == max(1, int(np.ceil(12 * (h / 0.02) ** 2)))
    # A multi-turn prompt is one item: its turns are resampled together (here: two halves of each row).
    split = {k: _replay({f"{p}#{t}": [c // 2 + (c % 2) * t for c in row] for p, row in
                          ((key.split("#")[0], row) for key, row in r.per_prompt.items()) for t in (0, 1)})
             for k, r in replays.items()}  # fmt: skip
    again = compare_intervals(split, ["base", "fast"], benches, "base", points, Bootstrap(1000, 0))["fast"]
    assert again.mean_ratio == iv.mean_ratio and again.prompts == {"b1": 12, "b2": 12}


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--bootstrap-resamples", "5"], "--bootstrap-resamples must be ≥ 100, got 5"),
        (["--bootstrap-seed", "-1"], "--bootstrap-seed must be ≥ 0, got -1"),
    ],
)
def test_bad_bootstrap_flags_are_one_line_errors(uri, data_dir, checkpoints, tmp_path, capsys, extra, message):
    a, _ = checkpoints
    assert main(_args(data_dir, tmp_path / "out", [f"x={a}"], *extra)) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert get_client().get_experiment_by_name("drelay-compare") is None and not (tmp_path / "out").exists()


@pytest.fixture
def headed(tiny, tmp_path) -> tuple[Path, Path]:
    """(a native checkpoint with a Domino head installed by `drelay heads add`, a checkpoint of another
    drafter whose heads/domino.safetensors was copied from the first: a head that does not fit)."""
    drafter = _drafter(tiny, 0)
    save_drafter(drafter, tmp_path / "own")
    add_head(_with_selector(drafter, tmp_path / "stage", "domino", 3), tmp_path / "own")
    other = save_drafter(_drafter(tiny, 4), tmp_path / "other")
    (other / "heads").mkdir()
    shutil.copyfile(head_path(tmp_path / "own", "domino"), head_path(other, "domino"))
    return tmp_path / "own", other


def test_an_installed_head_serves_compare_eval_and_study(tiny, headed, tmp_path, capsys):
    own, other = headed
    variants, _ = parse_variants([f"native={own}:native", f"domino={own}:domino"], None)
    assert [(v.selector, v.checkpoint) for v in variants] == [("native", str(own)), ("domino", str(own))]
    assert resolve_method("domino", target_spec="tiny-llama", checkpoint=str(own)).checkpoint == str(own)  # eval, generate
    with pytest.raises(DRelayError) as exc:
        read_head(other, "domino")
    mismatch = str(exc.value)
    assert "trained on another drafter" in mismatch
    for args in (
        ["compare", "--target", "tiny-llama", "--no-mlflow", "--out", str(tmp_path / "o"), "--variant", f"d={other}:domino"],
        ["eval", "--target", "tiny-llama", "--no-mlflow", "--out", str(tmp_path / "e"), "--methods", "domino", "--checkpoint", str(other)],
        ["generate", "--target", "tiny-llama", "--method", "domino", "--checkpoint", str(other), "--prompt", "hi"],
    ):  # fmt: skip
        assert main(args) == 2, args[0]
        err = capsys.readouterr().err
        assert mismatch in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "o").exists() and not (tmp_path / "e").exists()

    # A study checks the checkpoints it compares from outside before anything trains.
    doc = {"name": "s", "stages": [{"config": str(ROOT / "platform/experiments/smollm2-135m/train.yaml"), "runs": {"base": []}}],
           "compare": {"checkpoints": {"dom": f"{own}:domino"}}}  # fmt: skip
    spec = tmp_path / "study.yaml"
    spec.write_text(yaml.safe_dump(doc))
    assert main(["study", "--spec", str(spec), "--dry-run"]) == 0
    doc["compare"]["checkpoints"]["bad"] = f"{other}:domino"
    spec.write_text(yaml.safe_dump(doc))
    capsys.readouterr()
    assert main(["study", "--spec", str(spec), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("drelay: error: compare.checkpoints.bad: ") and mismatch in err and err.count("\n") == 1


def test_a_study_comparison_carries_the_intervals(tiny, uri, data_dir, checkpoints, tmp_path, monkeypatch):
    """`drelay study`'s comparison is `run_compare` with the spec's bootstrap settings."""
    from pipelines.study import runner
    from pipelines.study.spec import final_checkpoint, load_study, run_configs

    a, b = checkpoints
    repo = lambda p: Path(p) if Path(p).is_absolute() else tmp_path / "repo" / p  # noqa: E731
    doc = {"name": "s", "stages": [{"config": str(ROOT / "platform/experiments/smollm2-135m/train.yaml"),
                                    "overrides": ["target.spec=tiny-llama"], "runs": {"native": [], "drelay": []}}],
           "compare": {"baseline": "native", "variants": {"pick": "drelay:native"}, "checkpoints": {"outside": f"{a}"},
                       "benchmarks": "gsm8k", "limit": 2, "max_new_tokens": 8, "data_dir": str(data_dir),
                       "bootstrap_resamples": 400, "bootstrap_seed": 5}}  # fmt: skip
    (tmp_path / "study.yaml").write_text(yaml.safe_dump(doc))
    spec = load_study(tmp_path / "study.yaml")
    configs = run_configs(spec, repo)
    for label, source in (("native", a), ("drelay", b)):
        shutil.copytree(source, final_checkpoint(configs[label], repo))
    monkeypatch.setattr(runner, "repo_path", repo)
    runner._compare(spec, configs, progress=False, parent_run_id=None)
    result = json.loads((tmp_path / "repo" / "outputs" / "compare" / "s" / "compare.json").read_text())
    assert result["bootstrap"] == {"resamples": 400, "seed": 5, "level": 0.95}
    assert set(result["verdicts"]) == {"drelay", "pick", "outside"} and result["verdicts"]["outside"] == UNRESOLVED
    for label in ("drelay", "pick", "outside"):
        m = result["metrics"][label]
        assert m["ratio_vs_baseline_ci_low"] <= m["ratio_vs_baseline"] <= m["ratio_vs_baseline_ci_high"]
    client = get_client()
    run = client.search_runs([client.get_experiment_by_name("drelay-compare").experiment_id])[0]
    assert "drelay/gsm8k/ratio_vs_baseline_ci_high" in run.data.metrics and run.data.params["bootstrap_seed"] == "5"
