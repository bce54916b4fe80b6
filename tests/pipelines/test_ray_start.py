"""Starting or joining Ray from a command: a failure is one line naming what chose the cluster."""

from __future__ import annotations

import pytest

from drelay_model.errors import DRelayError
from pipelines.common.ray_start import start_ray


def test_a_failed_start_is_one_line_naming_the_address(monkeypatch):
    import ray

    def refuse(**kwargs):
        raise ConnectionError("Could not find any running Ray instance.\nPlease specify the one to connect to.")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", refuse)
    with pytest.raises(DRelayError, match=r"^could not start or join the cluster at ray.address='ray://x:10001': Could not find"):
        start_ray(address="ray://x:10001")

    def dashboard_timeout(**kwargs):
        raise Exception("\nThe last 20 lines of dashboard.log:\n...")  # what Ray raises when its head is late

    monkeypatch.setattr(ray, "init", dashboard_timeout)
    with pytest.raises(DRelayError, match=r"^could not start or join a local Ray cluster: The last 20 lines") as info:
        start_ray()
    assert "\n" not in str(info.value)


def test_an_initialised_ray_is_left_alone(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "init", lambda **kwargs: pytest.fail("ray.init called twice"))
    start_ray(address="auto")


def test_the_session_is_lowered_only_once_ray_is_up(monkeypatch):
    """A job under `setsid nice` lowers its autogroup after `ray.init`, never before or on a failure."""
    import ray

    import pipelines.common.ray_start as rs

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append("init"))
    monkeypatch.setattr(rs, "autogroup_follows_nice", lambda: calls.append("lower"))
    start_ray()
    assert calls == ["init", "lower"]

    def refuse(**kwargs):
        raise ConnectionError("no Ray here")

    calls.clear()
    monkeypatch.setattr(ray, "init", refuse)
    with pytest.raises(DRelayError):
        start_ray(address="ray://x:1")
    assert calls == []
