"""`drelay eval` resumes from cell files of an older layout: nothing decoded, every metric unchanged."""

import pytest

from cli import main
from pipelines.eval.runner import Evaluation


def test_eval_resumes_from_cell_files_of_an_older_layout(tmp_path, capsys, monkeypatch):
    """tests/pipelines/fixtures/cells_before_layout/ holds cell files in an older layout (written by
    `drelay eval` at commit 87b113f): the same command loads both cells, decodes nothing, and every
    metric they gave is unchanged."""
    import json
    import shutil
    from pathlib import Path

    bench = tmp_path / "bench" / "gsm8k"
    bench.mkdir(parents=True)
    rows = [{"question": f"Tom has {n} apples and buys {n + 1} more. How many apples does he have?"} for n in range(3)]
    (bench / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    shutil.copytree(Path(__file__).parent / "fixtures" / "cells_before_layout", out / "cells")

    def no_decoding(*args, **kwargs):
        raise AssertionError("a cell was recomputed instead of loaded")

    monkeypatch.setattr(Evaluation, "run_cell", no_decoding)
    rc = main(
        [
            "eval",
            "--target",
            "tiny-llama",
            "--methods",
            "ar,native",
            "--random-drafter",
            "--benchmarks",
            "gsm8k",
            "--limit",
            "2",
            "--data-dir",
            str(tmp_path / "bench"),
            "--max-new-tokens",
            "8",
            "--no-mlflow",
            "--out",
            str(out),
            "--no-progress",
            "--timing",
            "phased",
            "--verify-length",
            "fixed",
        ]
    )  # fmt: skip  (the fixture's cells were timed in phases, at fixed length)
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    old = json.loads(
        (Path(__file__).parent / "fixtures" / "cells_before_layout_summary.json").read_text()
    )  # the metrics the fixture's cells gave
    assert summary.keys() == old.keys()
    for method, metrics in old.items():  # each of those metrics, unchanged (the summary may add more)
        assert {k: summary[method][k] for k in metrics} == pytest.approx(metrics), method
    # the old cells carry each prompt's rounds and times: τ and S get their intervals from them
    native = summary["native"]
    for name in ("gsm8k/tau", "gsm8k/speedup", "mean_tau", "mean_speedup"):
        assert native[f"{name}_ci_low"] <= native[name] <= native[f"{name}_ci_high"], name
