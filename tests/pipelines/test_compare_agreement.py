"""analysis/compare_agreement.py: each run's ratio against the other's interval, both ways."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("compare_agreement", ROOT / "analysis" / "compare_agreement.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(folder: Path, gsm8k: tuple[float, float, float], mean: tuple[float, float, float]) -> Path:
    folder.mkdir()
    metrics = {"ratio_vs_baseline": mean[0], "ratio_vs_baseline_ci_low": mean[1], "ratio_vs_baseline_ci_high": mean[2]}
    metrics.update({"gsm8k/ratio_vs_baseline": gsm8k[0], "gsm8k/ratio_vs_baseline_ci_low": gsm8k[1],
                    "gsm8k/ratio_vs_baseline_ci_high": gsm8k[2], "gsm8k/tau": 1.9})  # fmt: skip
    doc = {"baseline": "native", "metrics": {"native": {"ratio_vs_baseline": 1.0}, "drelay": metrics}}
    (folder / "compare.json").write_text(json.dumps(doc))
    return folder


def test_agreement_is_checked_both_ways(tmp_path, capsys):
    mod = _module()
    a = _run(tmp_path / "a", (1.03, 1.02, 1.05), (1.012, 1.007, 1.018))
    b = _run(tmp_path / "b", (1.06, 1.01, 1.11), (1.02, 1.00, 1.04))
    rows = {name: (a_in_b, b_in_a) for _, name, _, _, a_in_b, b_in_a in mod.agreement(mod.read_ratios(a), mod.read_ratios(b))}
    assert rows == {"mean": (True, False), "gsm8k": (True, False)}  # b's point lies outside a's narrower interval
    out = subprocess.run([sys.executable, str(ROOT / "analysis/compare_agreement.py"), str(a), str(b)],
                         capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert out.returncode == 0 and "0 of 2 ratios agree both ways" in out.stdout
    missing = subprocess.run([sys.executable, str(ROOT / "analysis/compare_agreement.py"), str(a), str(tmp_path / "nope")],
                             capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert missing.returncode == 2 and "no compare.json" in missing.stderr and "Traceback" not in missing.stderr
