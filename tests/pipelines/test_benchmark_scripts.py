"""The scripts in benchmarks/ (performance) and analysis/ answer bad input like `drelay` does: one line on stderr, exit 2."""

import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Runs each script as __main__ (runpy) in one child interpreter, so torch and the project are imported
# once for all of them; prints one JSON list of {code, stderr}: the exit code, or "traceback" when the
# script raised anything but SystemExit.
_DRIVER = r"""
import contextlib, io, json, os, runpy, sys, traceback
results, path = [], list(sys.path)
for script, args in json.loads(sys.argv[1]):
    err, code = io.StringIO(), 0
    sys.argv, sys.path = [script, *args], [os.path.dirname(script), *path]  # as `python script.py` sets them
    with contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:
            code = exc.code
        except BaseException:
            traceback.print_exc()
            code = "traceback"
    results.append({"code": code, "stderr": err.getvalue()})
print(json.dumps(results))
"""

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
    ("benchmarks/bench_packed.py", ["--target", "nope"], "unknown target 'nope'"),
]


@pytest.fixture(scope="module")
def bad_input_runs() -> list[dict]:
    calls = [(str(ROOT / script), args) for script, args, _ in BAD_INPUTS]
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER, json.dumps(calls)], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", range(len(BAD_INPUTS)), ids=[f"{s}-{a[-1]}" for s, a, _ in BAD_INPUTS])
def test_bad_input_is_one_line_and_exit_2(bad_input_runs, case):
    script, _, message = BAD_INPUTS[case]
    run = bad_input_runs[case]
    assert run["code"] == 2, run["stderr"][-2000:]
    last = run["stderr"].strip().splitlines()[-1]
    assert last.startswith(f"{Path(script).name}: error: ") and message in last
    assert "Traceback" not in run["stderr"]


def _run_as_main(script: Path, args: list[str], monkeypatch, capsys) -> tuple[object, str]:
    """`python SCRIPT ARGS` in this process (runpy, as the driver above does): its exit code and stderr.
    Anything but SystemExit propagates and fails the test, as a traceback would."""
    monkeypatch.setattr(sys, "argv", [str(script), *args])
    monkeypatch.syspath_prepend(str(script.parent))
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(script), run_name="__main__")
    return exit_.value.code, capsys.readouterr().err


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
