"""`drelay report`: the Table-1 layout, relative improvements, and reading evaluations back from MLflow."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from cli import main
from pipelines.eval.report import (
    ComparisonTable,
    MethodRow,
    csv_rows,
    markdown_relative,
    markdown_table,
    relative_improvements,
    render,
    write_report,
)
from pipelines.common.tracking import get_client

NATIVE = {"gsm8k/speedup": 2.0, "gsm8k/tau": 4.0, "mbpp/speedup": 1.0, "mbpp/tau": 2.0, "mean_speedup": 1.5, "mean_tau": 3.0}
DRELAY = {"gsm8k/speedup": 3.0, "gsm8k/tau": 6.0, "gsm8k/speedup_std": 0.25, "mean_speedup": 2.25, "mean_tau": 4.5,
          "mean_tau_replay": 4.5, "mean_oracle_tau": 5.0}  # fmt: skip


def _table() -> ComparisonTable:
    return ComparisonTable(("gsm8k", "mbpp"), [MethodRow("native", NATIVE), MethodRow("drelay", DRELAY)], ["a note"])


def test_markdown_table_has_the_paper_layout():
    lines = markdown_table(_table()).splitlines()
    assert lines[0] == "| Method | GSM8K S | GSM8K τ | MBPP S | MBPP τ | Avg. S | Avg. τ |"
    assert lines[2] == "| native | 2.00× | 4.00 | 1.00× | 2.00 | 1.50× | 3.00 |"
    assert lines[3] == "| drelay | 3.00× ± 0.25 | 6.00 | – | – | 2.25× | 4.50 |"  # std at T > 0, gaps shown
    assert "a note" in lines[-1]


def test_relative_improvement_of_each_method_over_each_other():
    rel = {(d["method"], d["over"]): d for d in relative_improvements(_table().rows)}
    assert set(rel) == {("native", "drelay"), ("drelay", "native")}
    assert rel[("drelay", "native")]["rel_S_pct"] == pytest.approx(50.0)
    assert rel[("drelay", "native")]["rel_tau_pct"] == pytest.approx(50.0)
    assert rel[("native", "drelay")]["rel_S_pct"] == pytest.approx(-100 / 3)
    md = markdown_relative(_table().rows)
    assert "| drelay | +50.0% / +50.0% | — |" in md
    assert markdown_relative([MethodRow("native", NATIVE)]).startswith("(one method")
    text = render(_table(), "title")
    assert "## title" in text and "Greedy replay diagnostics" in text


def test_report_files(tmp_path):
    paths = write_report(_table(), tmp_path, "t")
    assert [p.name for p in paths] == ["report.md", "report.csv", "relative.csv"]
    rows = list(csv.DictReader((tmp_path / "report.csv").open()))
    assert rows[0]["method"] == "native" and float(rows[0]["gsm8k_S"]) == 2.0 and float(rows[1]["avg_tau"]) == 4.5
    assert list(rows[0])[:6] == ["method", "gsm8k_S", "gsm8k_S_std", "gsm8k_S_ci_low", "gsm8k_S_ci_high", "gsm8k_tau"]
    assert csv_rows(_table())[1]["mbpp_S"] is None
    rel = list(csv.DictReader((tmp_path / "relative.csv").open()))
    assert len(rel) == 2 and {"rel_S_pct", "rel_tau_pct"} <= set(rel[0])


# ---- from MLflow ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Two tiny evaluations ('first', then 'second') in a temporary SQLite store."""
    root = tmp_path_factory.mktemp("report")
    data = root / "bench" / "gsm8k"
    data.mkdir(parents=True)
    data.joinpath("test.jsonl").write_text("".join(json.dumps({"question": f"What is {n} + {n}?"}) + "\n" for n in range(2)))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
        for name in ("first", "second"):
            rc = main(["eval", "--target", "tiny-llama", "--random-drafter", "--data-dir", str(root / "bench"), "--benchmarks", "gsm8k",
                       "--max-new-tokens", "5", "--no-progress", "--run-name", name, "--out", str(root / name)])  # fmt: skip
            assert rc == 0
        yield root, mp


def _report(capsys, *argv):
    rc = main(["report", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_report_reads_the_latest_or_a_named_evaluation(store, capsys, monkeypatch):
    root, _ = store
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    rc, out, err = _report(capsys)
    assert rc == 0, err
    assert out.startswith("## second (tiny-llama, T=0, checkpoint random")
    assert "| Method | GSM8K S | GSM8K τ | Avg. S | Avg. τ |" in out and "| native | " in out
    expected = json.loads((root / "second" / "summary.json").read_text())["native"]
    s, tau = (f"{expected[f'gsm8k/{k}']:.2f} [{expected[f'gsm8k/{k}_ci_low']:.2f}, {expected[f'gsm8k/{k}_ci_high']:.2f}]"
              for k in ("speedup", "tau"))  # fmt: skip
    assert s.startswith(f"{expected['gsm8k/speedup']:.2f} [")
    assert f"| native | {s.replace(' [', '× [', 1)} | {tau} |" in out  # each with its 95% interval
    assert "95% interval, bootstrap over each benchmark's prompts" in out and "2000 resamples, seed 0" in out
    first_id = (
        get_client()
        .search_runs([get_client().get_experiment_by_name("drelay-eval").experiment_id], "attributes.run_name = 'first'")[0]
        .info.run_id
    )
    rc, out, err = _report(capsys, "--run", first_id, "--run", "second", "--out", str(root / "cmp"), "--plots")
    assert rc == 0, err
    assert "| first:native |" in out and "| second:native |" in out and "+" in out  # relative improvements
    assert (root / "cmp" / "report.md").is_file() and (root / "cmp" / "plots" / "tau_speedup.png").stat().st_size > 0


def test_unknown_run_is_a_one_line_error(store, capsys, monkeypatch):
    root, _ = store
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    rc, _, err = _report(capsys, "--run", "nope")
    assert rc == 2 and "no finished evaluation run named or with id 'nope'" in err and err.count("\n") == 1
    rc, _, err = _report(capsys, "--experiment", "missing")
    assert rc == 2 and "no MLflow experiment 'missing'" in err
    assert isinstance(root, Path)
