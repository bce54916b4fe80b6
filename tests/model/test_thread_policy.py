"""The engine's CPU thread policy (drelay_model/kernels/threads.py): the rule, its settings, that it
applies per thread, that a real busy process takes a core from it, and that outputs never depend on it."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch

from drelay_model.decoding import GenerationConfig, SpeculativeEngine
from drelay_model.errors import DRelayError
from drelay_model.kernels.threads import CpuSample, ThreadPolicy, allowed_cores, slack_for, threads_for
from drelay_model.selectors import NativeSelector


@pytest.mark.parametrize(
    ("others", "allowed", "threads"),
    [
        (0.0, 2, 2),
        (0.08, 2, 2),
        (0.25, 2, 2),
        (0.35, 2, 1),
        (0.67, 2, 1),
        (1.05, 2, 1),
        (3.0, 2, 1),
        (0.95, 4, 3),
        (1.2, 4, 3),
        (1.35, 4, 2),
        (-0.1, 1, 1),
    ],
)
def test_threads_leave_every_core_another_process_keeps_busy(others, allowed, threads):
    assert threads_for(others, allowed) == threads


@pytest.mark.parametrize("bad", ["x", "0", 0, -2, "1.5", True])
def test_a_bad_thread_setting_is_one_line(bad):
    with pytest.raises(DRelayError, match="threads must be a positive integer or auto"):
        ThreadPolicy.parse(bad)


def test_settings_parse_and_building_a_policy_changes_nothing():
    before = torch.get_num_threads()
    fixed, auto = ThreadPolicy.parse("3"), ThreadPolicy.parse("auto")
    assert (fixed.threads, fixed.describe_setting(), auto.auto, auto.describe_setting()) == (3, "3", True, "auto")
    assert ThreadPolicy.parse(None).auto and auto.current == allowed_cores()
    assert torch.get_num_threads() == before


def test_update_applies_the_count_in_the_thread_that_runs_the_rounds():
    """OpenMP keeps the count per thread: a serving batcher's thread must get it, not only its builder."""
    target = 2 if torch.get_num_threads() != 2 else 3
    policy = ThreadPolicy(target)
    seen = []

    def rounds():
        policy.update()
        seen.append(torch.get_num_threads())

    worker = threading.Thread(target=rounds)
    worker.start()
    worker.join()
    assert seen == [target]


@pytest.mark.skipif(allowed_cores() < 2 or CpuSample.now() is None, reason="needs Linux /proc/stat and ≥ 2 allowed cores")
def test_auto_gives_a_core_to_a_real_busy_process():
    policy = ThreadPolicy(interval_s=0.2)
    spin = subprocess.Popen([sys.executable, "-c", "while True:\n    pass\n"])
    try:
        time.sleep(1.0)  # this process sleeps: the busy seconds are the competitor's
        policy.update()
        assert policy.current <= allowed_cores() - 1, policy.describe()
    finally:
        spin.kill()
        spin.wait()


def test_outputs_do_not_depend_on_the_thread_count(target, make_drafter, prompts_of):
    prompts = prompts_of(target.vocab_size, (5, 8))
    drafter = make_drafter(target, top_k=8)
    cfg = GenerationConfig(max_new_tokens=20)
    one = SpeculativeEngine(target, drafter, NativeSelector(), threads=ThreadPolicy(1)).generate(prompts, cfg).tokens
    auto = SpeculativeEngine(target, drafter, NativeSelector(), threads=ThreadPolicy(interval_s=1e-6)).generate(prompts, cfg)
    assert auto.tokens == one == SpeculativeEngine(target).generate(prompts, cfg).tokens


def test_auto_decides_on_a_window_so_one_burst_keeps_the_threads(monkeypatch):
    """Other processes' use per 1 s interval: 0, 0.5 (a burst), 0, then 0.5 twice (sustained). With
    the 2-interval window the burst averages to 0.25 (below the 0.3 slack) and the sustained use
    takes a core; with a 1-interval window the burst alone would."""
    others = [0.0, 0.5, 0.0, 0.5, 0.5]
    walls = list(range(len(others) + 1))
    busy = [0.0] + [sum(others[: i + 1]) for i in range(len(others))]
    script = iter(
        [CpuSample(wall=float(w), busy=b + w, own=float(w)) for w, b in zip(walls, busy)]
    )  # decoding: a core of its own
    monkeypatch.setattr(CpuSample, "now", classmethod(lambda cls: next(script)))
    monkeypatch.setattr("drelay_model.kernels.threads.allowed_cores", lambda: 2)
    policy = ThreadPolicy(interval_s=1e-9)
    seen = [policy.update() for _ in others]
    assert seen == [2, 2, 2, 2, 1]
    with pytest.raises(DRelayError, match="window"):
        ThreadPolicy(window=0)


def test_batched_rounds_tolerate_more_of_another_process():
    """Measured break-evens: 0.3 of a core at one row, about 0.5 at eight, 0.6 at sixteen (longer
    parallel regions)."""
    assert slack_for(1) == pytest.approx(0.3) and slack_for(16) == pytest.approx(0.6) == slack_for(64)
    assert 0.3 < slack_for(2) < slack_for(4) < slack_for(8) < 0.6 and slack_for(8) == pytest.approx(0.525)
    assert threads_for(0.4, 2, slack_for(1)) == 1
    assert threads_for(0.55, 2, slack_for(16)) == 2 and threads_for(0.55, 2, slack_for(4)) == 1
    assert threads_for(0.6, 2, slack_for(16)) == 1


def test_after_an_idle_spell_the_window_restarts_after_one_decision(monkeypatch):
    """The engine waits 10 s for requests while another process uses 1.5 cores, then decodes beside
    nothing: the first update decides on the spell (one thread: the competitor may still run), and
    the next on the fresh interval alone, not on a window that still holds the spell."""
    samples = [
        CpuSample(wall=0.0, busy=0.0, own=0.0),
        CpuSample(wall=10.0, busy=15.0, own=0.1),  # idle: another process held 1.5 cores
        CpuSample(wall=10.5, busy=16.1, own=1.1),  # decoding on both cores beside nothing
        CpuSample(wall=11.0, busy=17.1, own=2.1),
    ]
    script = iter(samples)
    monkeypatch.setattr(CpuSample, "now", classmethod(lambda cls: next(script)))
    monkeypatch.setattr("drelay_model.kernels.threads.allowed_cores", lambda: 2)
    policy = ThreadPolicy(interval_s=0.5)
    seen = [policy.update() for _ in samples[1:]]
    assert seen == [1, 2, 2]


@pytest.mark.parametrize(("others_after", "expected"), [(0.1, 2), (1.0, 1)])
def test_after_an_idle_spell_the_burst_decides_within_restart_s(monkeypatch, others_after, expected):
    """A spell of 10 s beside 1.5 cores of others, then a burst: the first round decides on the spell
    (one thread), the next decision comes 0.2 s later on that short window alone: two threads if the
    others stopped as the burst began (a paired benchmark's other endpoint), one if they stayed (a
    persistent competitor). Before restart_s has passed nothing is re-measured."""
    clock = [0.0]

    def sample_now(cls):  # others: 1.5 cores until 10 s, then `others_after`; this process: a core from 10 s
        t = clock[0]
        own = 0.1 * min(t, 10.0) / 10.0 + max(t - 10.0, 0.0)
        others = 1.5 * min(t, 10.0) - 0.1 * min(t, 10.0) / 10.0 + others_after * max(t - 10.0, 0.0)
        return CpuSample(t, others + own, own)

    monkeypatch.setattr(CpuSample, "now", classmethod(sample_now))
    monkeypatch.setattr("drelay_model.kernels.threads.allowed_cores", lambda: 2)
    monkeypatch.setattr("drelay_model.kernels.threads.time.monotonic", lambda: clock[0])
    policy = ThreadPolicy(interval_s=0.5, restart_s=0.2)
    seen = []
    for t in (10.0, 10.1, 10.25, 10.75):
        clock[0] = t
        seen.append(policy.update(rows=8))
    assert seen == [1, 1, expected, expected]
    with pytest.raises(DRelayError, match="restart_s"):
        ThreadPolicy(restart_s=0.0)
