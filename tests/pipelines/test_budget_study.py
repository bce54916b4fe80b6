"""The budget study's report (analysis/budget_study.py): the log-time fit, the kept CSV, the table."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest

from drelay_model.errors import DRelayError

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


def test_the_projection_carries_the_fits_interval():
    """Flat, noisy points over a short span (a continued run's 45 minutes): the interval says so; an
    exact curve has none wider than rounding; two points give none."""
    bs = _module()
    noise = [0.004, -0.006, 0.005, -0.003, 0.0]
    flat = [bs.Point("d2", 15 * i, 50 + 0.15 * i, {"t": 1.84 + e}) for i, e in enumerate(noise)]
    fit = bs.fit_log(flat, "t")
    lo, hi = fit.interval_at(58.0)
    assert lo < fit.at(58.0) < hi and hi - lo > 0.2  # 45 minutes on a 50-hour clock resolve nothing at 58 h
    exact = [bs.Point("d2", s, h, {"t": 1.2 + 0.1 * math.log(h)}) for s, h in ((1, 0.2), (2, 0.4), (3, 0.75))]
    lo, hi = bs.fit_log(exact, "t").interval_at(8.0)
    assert hi - lo < 1e-6
    assert bs.projected(bs.fit_log(exact[:2], "t"), 8.0).endswith("[–]")


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


def test_a_run_continued_on_a_fresh_machine_keeps_its_earlier_points():
    bs = _module()
    kept = [bs.Point("joint", 60, 0.4, {"val/tau": 1.60}), bs.Point("joint", 120, 0.8, {"val/tau": 1.61}),
            bs.Point("other", 15, 0.1, {"val/tau": 1.5})]  # fmt: skip
    store = [bs.Point("joint", 120, 0.8, {"val/tau": 1.62}), bs.Point("joint", 180, 1.2, {"val/tau": 1.63})]
    merged = bs.merge_kept(store, kept, order=["joint", "other"])
    assert [(p.run, p.step, p.values["val/tau"]) for p in merged] == [
        ("joint", 60, 1.60), ("joint", 120, 1.62), ("joint", 180, 1.63), ("other", 15, 1.5)]  # fmt: skip


def test_report_projects_speedup_from_costs(capsys):
    bs = _module()
    pts = [bs.Point("d2", s, h, {"val/tau_native": 1.5 + 0.1 * math.log(h)}) for s, h in ((100, 0.25), (200, 0.5))]
    fits = bs.report(
        pts, {"d2": 2, "d3": 3}, {"ar": 20.0, "draft2": 10.0, "draft3": 14.0, "verify16": 30.0}, hours=1.0, fit_from=0.1
    )
    out = capsys.readouterr().out
    assert "| d3 | 3 | — | not trained yet |" in out and "d2" in fits
    assert out.count("|---") == 13  # every row has the header's columns
    gain = {"val/repair_gain": 1.031, "val/repair_gain_ci_low": 1.004, "val/repair_gain_ci_high": 1.06}
    assert bs.repair_gain(gain) == "1.031 [1.004, 1.060]" and bs.repair_gain({}) == "—"
    assert f"{1.5 * 20.0 / 40.0:.2f}×" in out  # S = τ(1 h) · t_AR / (t_draft + t_verify16)


def test_continued_runs_count_their_checkpoint_depth_and_draw_a_step_zero_point(tmp_path):
    """A run that continues a checkpoint trains its layers plus the grown ones; its step-0 point
    (0 budget minutes) is drawn on the whole training's clock, and left off a log axis without it."""
    from types import SimpleNamespace

    from drelay_model.drafter import BlockDrafter, DrafterConfig, save_drafter
    from drelay_model.target import tiny_target

    bs = _module()
    target = tiny_target("tiny-llama")
    save_drafter(BlockDrafter(DrafterConfig.for_target(target, num_layers=2), target), tmp_path / "ck")
    grown = SimpleNamespace(drafter=SimpleNamespace(init_checkpoint="ck", grow_layers=1, num_layers=2))
    fresh = SimpleNamespace(drafter=SimpleNamespace(init_checkpoint=None, grow_layers=0, num_layers=4))
    assert bs.drafter_depth(grown, lambda p: tmp_path / p) == 3
    assert bs.drafter_depth(fresh, lambda p: tmp_path / p) == 4
    # a later stage starting from a run of the study that has not exported yet: unknown, not an error
    later = SimpleNamespace(drafter=SimpleNamespace(init_checkpoint="out/long/drafter", grow_layers=0, num_layers=2))
    assert bs.drafter_depth(later, lambda p: tmp_path / p, frozenset({tmp_path / "out/long/drafter"})) is None
    with pytest.raises(DRelayError, match="not found"):  # a missing checkpoint that no run of the study makes
        bs.drafter_depth(later, lambda p: tmp_path / p)
    pts = [bs.Point("d3", s, h, {"val/tau_native": 1.4 + 0.01 * s / 15}) for s, h in ((0, 0.0), (15, 0.15), (30, 0.3))]
    bs.plot(pts, {"d3": bs.fit_log(pts)}, tmp_path / "scratch.png", hours=1.0)  # h = 0 off the log axis
    total = [bs.replace(p, hours=p.hours + 3.0) for p in pts]
    fit = bs.fit_log(total)
    assert fit.n == 3  # the step-0 point joins the fit at H0
    bs.plot(total, {"d3": fit}, tmp_path / "total.png", hours=11.0)
    assert (tmp_path / "scratch.png").stat().st_size > 0 and (tmp_path / "total.png").stat().st_size > 0


def test_the_teacher_forced_tau_is_derived_from_the_accepted_run():
    bs = _module()
    p = bs.Point("d2", 15, 0.2, {"val/tf_accept": 0.61, "val/tau_native": 1.8})
    assert p.values[bs.TAU_TF] == pytest.approx(1.61) and bs.fit_log([p, bs.replace(p, hours=0.4)], bs.TAU_TF).n == 2


def test_a_resumed_run_is_one_curve_across_its_mlflow_attempts(uri):
    """An interrupted attempt (FAILED) and the attempt that resumed it are two MLflow runs of one
    name: the curve has the points of both, the later attempt's at a step both logged."""
    from pipelines.common.tracking import get_client

    bs = _module()
    client = get_client(uri)
    exp = client.create_experiment("drelay-train")
    for status, points in (("FAILED", {0: 1.60, 15: 1.58, 30: 1.50}), ("RUNNING", {30: 1.59, 45: 1.61})):
        run = client.create_run(exp, run_name="study-d2")
        for step, tau in points.items():
            client.log_metric(run.info.run_id, "val/tau_native", tau, step=step)
            client.log_metric(run.info.run_id, "train/budget_minutes", step / 3, step=step)
        if status == "FAILED":
            client.set_terminated(run.info.run_id, status)
    curve = bs.load_curves(client, "drelay-train", "study", ["d2", "d3"])
    assert [(p.run, p.step, p.values["val/tau_native"]) for p in curve] == [
        ("d2", 0, 1.60), ("d2", 15, 1.58), ("d2", 30, 1.59), ("d2", 45, 1.61)
    ]  # fmt: skip
    assert curve[-1].hours == pytest.approx(45 / 3 / 60)


def test_the_curves_go_to_the_studys_parent_run(uri, tmp_path):
    from pipelines.common.tracking import get_client

    bs = _module()
    client = get_client(uri)
    with pytest.raises(DRelayError, match="no MLflow run named 'study'"):
        bs.log_to_study_run(client, "drelay-train", "study", [])
    exp = client.create_experiment("drelay-train")
    parent = client.create_run(exp, run_name="study").info.run_id
    client.create_run(exp, run_name="study-d2")
    png, csv_file = tmp_path / "curve.png", tmp_path / "study.csv"
    png.write_bytes(b"png"), csv_file.write_text("run,step\n")
    assert bs.log_to_study_run(client, "drelay-train", "study", [png, csv_file]) == parent
    assert sorted(a.path for a in client.list_artifacts(parent, "curves")) == ["curves/curve.png", "curves/study.csv"]


def test_round_costs_are_measured_on_the_real_target():
    """--measure-costs: AR ms per token and, per depth, draft and whole-block verify ms per round."""
    bs = _module()
    costs = bs.measure_costs([2], repeats=1, tokens=4)
    assert set(costs) == {"ar", "draft2", "verify16"}
    assert all(v > 0 and math.isfinite(v) for v in costs.values())
