"""A job started under `setsid nice` puts its session's autogroup at its nice value; anywhere else
(not a session leader, nice 0) it leaves the group alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.common.priority import autogroup_follows_nice

ROOT = Path(__file__).resolve().parents[2]


def test_only_a_niced_session_leader_touches_its_group(tmp_path, monkeypatch):
    group = tmp_path / "autogroup"
    group.write_text("/autogroup-7 nice 0\n")
    monkeypatch.setattr(os, "nice", lambda inc: 19)
    monkeypatch.setattr(os, "getsid", lambda pid: 4242)
    monkeypatch.setattr(os, "getpid", lambda: 4242)
    assert autogroup_follows_nice(group) == 19 and group.read_text() == "19"
    group.write_text("/autogroup-7 nice 19\n")
    assert autogroup_follows_nice(group) is None  # already that low
    group.write_text("/autogroup-7 nice 0\n")
    monkeypatch.setattr(os, "getsid", lambda pid: 1)  # in the caller's session: its group is the caller's
    assert autogroup_follows_nice(group) is None and group.read_text().endswith("nice 0\n")
    monkeypatch.setattr(os, "getsid", lambda pid: 4242)
    monkeypatch.setattr(os, "nice", lambda inc: 0)
    assert autogroup_follows_nice(group) is None
    assert autogroup_follows_nice(tmp_path / "absent") is None  # no autogroups here


@pytest.mark.skipif(not Path("/proc/self/autogroup").is_file(), reason="this kernel has no autogroups")
def test_a_real_setsid_nice_process_lowers_its_own_group_and_not_ours():
    ours = Path("/proc/self/autogroup").read_text()
    code = ("from pipelines.common.priority import autogroup_follows_nice; autogroup_follows_nice(); "
            "print(open('/proc/self/autogroup').read().split()[-1])")  # fmt: skip
    out = subprocess.run(["setsid", "nice", "-n", "7", sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True)  # fmt: skip
    assert out.stdout.strip() == "7"
    assert Path("/proc/self/autogroup").read_text() == ours
