"""The scripts in benchmarks/ answer bad input like `drelay` does: one line on stderr, exit 2."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "script, args, message",
    [
        ("bench_selector.py", ["--checkpoint", "/nonexistent"], "checkpoint '/nonexistent' not found"),
        ("selector_decisions.py", ["--checkpoint", "/nonexistent"], "checkpoint '/nonexistent' not found"),
        ("trace_repairs.py", ["--checkpoint", "/nonexistent", "--cells", "/nonexistent"], "checkpoint '/nonexistent' not found"),
        ("trace_repairs.py", ["--checkpoint", str(ROOT / "checkpoints/smollm2-135m"), "--cells", "/nonexistent"], "--cells: no '/nonexistent/gsm8k__ar.json'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(script, args, message):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{script}: error: ") and message in last
    assert "Traceback" not in proc.stderr
