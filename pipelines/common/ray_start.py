"""Starting or joining a Ray cluster from a command, with a one-line error when that fails.

`ray.init` raises whatever its start-up hit: a `ConnectionError` for an address nobody answers, a
bare `Exception` carrying the dashboard's log when the head did not come up in time (seen on this
2-core machine at load averages near 100), a `RuntimeError` for a version mismatch. A command exits
through `cli.guarded`, which turns `DRelayError` into one line and exit status 2; this turns those
failures into that, naming `ray.address`, the config key that chose the cluster."""

from __future__ import annotations

from drelay_model.errors import DRelayError
from pipelines.common.priority import autogroup_follows_nice


def start_ray(*, address: str | None = None, **kwargs) -> None:
    """`ray.init(address=address, **kwargs)` unless Ray is already initialised in this process."""
    import ray

    if ray.is_initialized():
        return
    try:
        ray.init(address=address, **kwargs)
    except Exception as exc:  # noqa: BLE001 — every start-up failure becomes the same one-line error
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        where = f"the cluster at ray.address={address!r}" if address else "a local Ray cluster"
        raise DRelayError(f"could not start or join {where}: {first} (Ray's logs: /tmp/ray/session_latest/logs)") from exc
    # Only now, with Ray's daemons up: a job under `setsid nice` lowers its session's autogroup to its
    # nice value (priority.py). Lowered before, a local head's start-up can miss its deadline beside a
    # busy foreground (seen: "The current node timed out during startup").
    autogroup_follows_nice()
