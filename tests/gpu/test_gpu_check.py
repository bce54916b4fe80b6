"""The GPU check (benchmarks/gpu_check.sh, benchmarks/gpu/) checked on CPU before a GPU is lent: the
dry run names every step and why it would skip, the scripts import nothing the GPU machine lacks,
every step's code runs at test size on CPU (slow), and the report says which step failed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
STEPS = ("lossless", "accepted", "kernels", "graphs", "joint_step", "joint_step_8b")
# What the GPU machine lacks (it has torch, triton, transformers + its dependencies, numpy,
# safetensors, pytest): a script importing any of these would fail there.
ABSENT_ON_GPU_MACHINE = ("ray", "mlflow", "pydantic", "pipelines", "deploy", "sglang", "vllm")
# A None entry in sys.modules is how Python spells "absent": `import x` raises ModuleNotFoundError
# and importlib.util.find_spec("x") answers None, as on a machine without the package.
BLOCKER = f"""
import runpy, sys
for name in {ABSENT_ON_GPU_MACHINE!r}:
    sys.modules[name] = None
"""
RUN_SCRIPT = 'sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name="__main__")'


def _without_absent_packages(code: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run python code (then `args`) in a fresh process where ABSENT_ON_GPU_MACHINE cannot be imported."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", BLOCKER + code, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env
    )


def _dry_run(tmp_path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "benchmarks/gpu_check.sh"), "--dry-run", *args, str(tmp_path / "report")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip reasons of a machine without CUDA")
def test_dry_run_says_every_step_is_ready_and_why_it_would_skip(tmp_path):
    """Run as on the GPU machine: `python3` only on the PATH (no `python`, no $PYTHON) and a copied
    tree's commit passed in (--commit wins over $GPU_CHECK_COMMIT)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "PYTHON")}
    env |= {"PATH": f"{bin_dir}:/usr/bin:/bin", "GPU_CHECK_COMMIT": "feedbee"}
    proc = _dry_run(tmp_path, env, "--commit", "0123abc")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[1].startswith("python      python3 (Python 3.") and lines[1].endswith("commit 0123abc")
    for step in ("env", "tests", *STEPS, "timing"):
        line = next((x for x in lines if x.startswith(step + " ")), "")
        assert " ready" in line and "NOT READY" not in line, (step, proc.stdout)
    for step in STEPS:
        assert "would skip here: no CUDA device" in next(x for x in lines if x.startswith(step + " "))
    assert "tests collected" in next(x for x in lines if x.startswith("tests "))
    assert not (tmp_path / "report").exists()  # a dry run writes nothing
    bad = subprocess.run(["bash", str(ROOT / "benchmarks/gpu_check.sh"), "--commit"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and bad.stderr.strip() == "gpu_check.sh: --commit needs a commit id"


def test_the_scripts_import_nothing_the_gpu_machine_lacks():
    proc = _without_absent_packages(
        RUN_SCRIPT, str(ROOT / "benchmarks/gpu/run_step.py"), "--dry-run", "--device", "cpu", timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    imports = "\n".join(f"import benchmarks.gpu.check_{s}" for s in STEPS) + "\nimport benchmarks.gpu.report"
    proc = _without_absent_packages(imports, timeout=300)
    assert proc.returncode == 0, proc.stderr
    proc = _without_absent_packages("import pipelines")  # the blocker itself works
    assert proc.returncode == 1 and "ModuleNotFoundError: import of pipelines halted" in proc.stderr


def test_bad_arguments_are_one_line_and_exit_2():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/gpu/run_step.py"), "warp"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 2 and "invalid choice: 'warp'" in proc.stderr and "Traceback" not in proc.stderr


def test_the_report_names_failed_timed_out_and_skipped_steps(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    records = {
        "env": {"step": "env", "ok": True, "result": {"torch": "2.11.0", "device": "NVIDIA H200", "commit": "0123abc"}},
        "tests": {
            "step": "tests",
            "ok": False,
            "result": {"tests": 40, "failures": 1, "errors": 0, "skipped": 0, "failed": ["t::x"]},
        },
        "lossless": {"step": "lossless", "ok": True, "skipped": "no CUDA device"},
        "graphs": {"step": "graphs", "ok": False, "error": "timed out after 75 s"},
        "joint_step": {"step": "joint_step", "ok": True, "seconds": 40.0, "result": {"half": "a partial result"}},
    }
    for name, rec in records.items():
        (work / f"{name}.json").write_text(json.dumps(rec))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/gpu/report.py"), str(work), str(out), "--seconds", "123"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    report = (out / "report.md").read_text()
    assert report.startswith("# GPU check ") and report.splitlines()[0].endswith("FAILED: 2 passed, 5 failed, 2 skipped, 123 s")
    assert "commit: 0123abc" in report.splitlines()
    assert "| graphs | FAILED: timed out after 75 s |" in report and "| lossless | skipped: no CUDA device |" in report
    assert "| kernels | FAILED: no record (the step did not finish) |" in report and "- failed: t::x" in report
    assert "(unexpected result: 'measured_activations_gib')" in report  # a partial result is shown raw, not a crash
    assert set(json.loads((out / "results.json").read_text())) == {
        "env",
        "tests",
        "lossless",
        "kernels",
        "graphs",
        "joint_step",
        "joint_step_8b",
        "accepted",
        "timing",
    }
    assert sorted(p.name for p in out.iterdir()) == ["report.md", "results.json"]


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


# Every step, then the timing script, in one fresh process (TRITON_INTERPRET set before any kernel is defined: CPU tensors),
# each through run_step.py's own `main`: one interpreter start and one torch import for all of them
# (gpu_check.sh gives each its own process, for its per-step time limit).
ALL_STEPS = """
import os; os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, sys.argv[1])
from benchmarks.gpu.run_step import main
out, steps = sys.argv[2], sys.argv[3:]
codes = {step: main([step, "--device", "cpu", "--scale", "tiny", "--out", f"{out}/{step}.json"]) for step in steps}
print("exit codes:", codes)
sys.argv = [f"{sys.argv[1]}/benchmarks/gpu_timing.py", "--device", "cpu", "--scale", "tiny", "--layers", "4",
            "--out", f"{out}/timing.txt"]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture(scope="module")
def tiny_records(tmp_path_factory):
    """step → (its JSON record or None, the run's output) for every step run at test size on CPU, and
    "timing" → (gpu_timing.py's report or None, the output), run after them in the same process."""
    out = tmp_path_factory.mktemp("gpu-steps")
    steps = [s for s in STEPS if s != "kernels" or _triton_importable()]
    proc = _without_absent_packages(ALL_STEPS, str(ROOT), str(out), *steps, timeout=900)
    log = proc.stdout[-3000:] + proc.stderr[-4000:]
    records = {s: (json.loads((out / f"{s}.json").read_text()) if (out / f"{s}.json").exists() else None, log) for s in steps}
    timing = out / "timing.txt"
    records["timing"] = (timing.read_text() if proc.returncode == 0 and timing.exists() else None, log)
    return records


@pytest.mark.slow
@pytest.mark.parametrize("step", STEPS)
def test_each_step_runs_at_test_size_on_cpu(step, tiny_records):
    """The step's own code end to end on CPU (no CUDA graph there: `graphs` traces the round with
    torch.compile(fullgraph=True), which fails on any host sync; `kernels` runs the Triton kernels
    interpreted), with the GPU machine's packages only."""
    if step == "kernels":
        pytest.importorskip("triton")
    record, log = tiny_records[step]
    assert record is not None, log
    assert record["ok"] and "skipped" not in record and "error" not in record, (record.get("error"), log)
    result = record["result"]
    if step == "graphs":
        assert all(i["bitwise_equal"] for b in result["batches"].values() for i in b["inputs"])
        assert all(b["draft_ms"] > 0 and b["select_ms"] > 0 for b in result["batches"].values())  # select ÷ draft
    if step.startswith("joint_step"):
        assert abs(result["activations_measured_over_plan"] - 1) <= result["shape"]["tolerance"]
        assert result["plan_attention"] == "sdpa-gqa"
    if step == "accepted":
        fp32 = result["dtypes"]["float32"]
        assert all(fp32["accept_hist"]) and fp32["tokens_equal_ar"] and fp32["lengths_after_every_round"]
    if step == "kernels":
        assert all(b["walk"]["same_picks"] and b["selector"]["same_paths"] for b in result["batches"].values())


@pytest.mark.slow
def test_timing_runs_at_test_size_on_cpu(tiny_records):
    """benchmarks/gpu_timing.py's code (Qwen3-4B-shaped layers on the GPU) at test size, with the GPU
    machine's packages only."""
    report, log = tiny_records["timing"]
    assert report is not None, log
    lines = report.splitlines()
    assert lines[0].startswith("target: test-shaped layers") and any(x.startswith("verify batch 8: G=1") for x in lines)
    assert any(x.startswith("speculative (native, untrained drafter):") for x in lines)
