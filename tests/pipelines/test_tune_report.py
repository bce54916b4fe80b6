"""`drelay tune`'s report: the best trial beside its start and its runner-up, with their intervals."""

from pathlib import Path


def test_the_best_trial_is_printed_beside_the_start():
    from pipelines.tune.report import SweepResult

    r = SweepResult(Path("."), "p", "t1", None, [], metric="val/tau", best_value=2.454, start_value=2.91)
    assert (
        r.best_against_start()
        == "best trial: t1 val/tau 2.4540; start (init checkpoint): val/tau 2.9100; the best trial does not beat its start"
    )
    beat = SweepResult(Path("."), "p", "t2", None, [], metric="loss", mode="min", best_value=0.5, start_value=0.7)
    assert beat.best_against_start().endswith("loss 0.7000; the best trial beats its start")
    assert SweepResult(Path("."), "p", None, None, []).best_against_start() == "best trial: none; start: no init checkpoint"


def test_the_best_trial_carries_its_interval_and_says_whether_the_runner_up_is_resolved():
    """Each trial's val/tau with its 95% interval over the validation prompts; the best is resolved from
    the runner-up only when the two intervals are apart."""
    from pipelines.tune.report import COMPLETED, STOPPED, SweepResult, ranked

    def row(tid, tau, low, high, status=COMPLETED):
        return {"trial_id": tid, "status": status, "val/tau": tau, "val/tau_ci_low": low, "val/tau_ci_high": high}

    rows = [row("t0", 1.50, 1.46, 1.54), row("t1", 1.47, 1.43, 1.51), row("t2", 1.60, 1.55, 1.65, STOPPED)]
    assert [r["trial_id"] for r in ranked(rows, "val/tau", "max")] == ["t0", "t1"]  # completed trials rank first
    r = SweepResult(Path("."), "p", "t0", None, rows, best_value=1.50, start_value=1.40, start_ci=(1.36, 1.44))
    assert r.best_against_start() == (
        "best trial: t0 val/tau 1.5000 [1.4600, 1.5400]; start (init checkpoint): val/tau 1.4000 [1.3600, 1.4400]; "
        "the best trial beats its start (95% intervals apart: resolved from its start)"
    )
    assert r.best_against_runner_up() == (
        "runner-up: t1 val/tau 1.4700 [1.4300, 1.5100] (95% intervals overlap: not resolved from the runner-up)"
    )
    apart = [row("t0", 1.50, 1.48, 1.52), row("t1", 1.40, 1.38, 1.42)]
    resolved = SweepResult(Path("."), "p", "t0", None, apart, best_value=1.50).best_against_runner_up()
    assert resolved.endswith("(95% intervals apart: resolved from the runner-up)")
    assert SweepResult(Path("."), "p", "t0", None, apart[:1], best_value=1.5).best_against_runner_up() == "runner-up: none"
