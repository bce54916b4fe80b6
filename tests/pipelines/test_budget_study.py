"""The budget study's report (analysis/budget_study.py): the log-time fit, the kept CSV, the table."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("budget_study", ROOT / "analysis/budget_study.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["budget_study"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_fit_recovers_a_log_curve_and_projects_it():
    bs = _module()
    pts = [bs.Point("d2", s, h, {"val/tau_native": 1.2 + 0.1 * math.log(h)}) for s, h in ((100, 0.2), (200, 0.4), (300, 0.75))]
    fit = bs.fit_log(pts)
    assert fit.a == pytest.approx(1.2) and fit.b == pytest.approx(0.1) and fit.rmse < 1e-9 and fit.n == 3
    assert fit.at(8.0) == pytest.approx(1.2 + 0.1 * math.log(8.0))
    assert bs.fit_log(pts[:1]) is None  # one point: no curve
    assert bs.fit_log(pts, fit_from=0.5) is None  # only one point at ≥ 0.5 h


def test_curves_round_trip_through_the_kept_csv(tmp_path):
    bs = _module()
    pts = [
        bs.Point("d3", 100, 0.25, {"val/tau_native": 1.31, "val/one_edit_gain": 0.4}),
        bs.Point("d3", 200, 0.5, {"val/tau_native": 1.4}),
    ]
    path = tmp_path / "study.csv"
    bs.write_csv(pts, path)
    back = bs.read_csv(path)
    assert [(p.run, p.step, p.hours, p.values) for p in back] == [(p.run, p.step, p.hours, p.values) for p in pts]


def test_report_projects_speedup_from_costs(capsys):
    bs = _module()
    pts = [bs.Point("d2", s, h, {"val/tau_native": 1.5 + 0.1 * math.log(h)}) for s, h in ((100, 0.25), (200, 0.5))]
    fits = bs.report(
        pts, {"d2": 2, "d3": 3}, {"ar": 20.0, "draft2": 10.0, "draft3": 14.0, "verify16": 30.0}, hours=1.0, fit_from=0.1
    )
    out = capsys.readouterr().out
    assert "| d3 | 3 | — | not trained yet |" in out and "d2" in fits
    assert f"{1.5 * 20.0 / 40.0:.2f}×" in out  # S = τ(1 h) · t_AR / (t_draft + t_verify16)
