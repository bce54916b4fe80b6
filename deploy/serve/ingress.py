"""How requests reach a replica: through Ray Serve's HTTP proxy only, or also straight to the replica.

`ingress: direct` (the default) starts the local Ray instance in Ray Serve's throughput-optimized mode
(`RAY_SERVE_THROUGHPUT_OPTIMIZED=1`: direct ingress, gRPC between proxy and replicas, the user's code
on the replica's own event loop). Each replica then answers HTTP on a port of its own, taken from
`direct_port` upwards, with no proxy hop and no per-chunk Ray call between the replica and the client;
Ray Serve's proxy still listens on `port` and balances over all replicas. With one replica the direct
URL is the faster one (docs/serving.md, "Ingress"); with several, clients or a load balancer spread
over the direct URLs, or use the proxy.

Ray reads these settings once, when its processes start: they apply to a Ray instance this process
starts, never to one already running (a cluster's head sets them for its own nodes).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ray.serve.schema import TargetGroup

DIRECT_PORTS = 1000  # the range Ray Serve allocates replica ports from: direct_port … direct_port + 999


def ray_serve_environment(direct_port: int) -> dict[str, str]:
    """The environment a Ray instance needs for direct ingress with replica ports from `direct_port`."""
    return {
        "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(direct_port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(direct_port + DIRECT_PORTS - 1),
        # A stopping replica keeps its port open this long for an external load balancer to drop it
        # (30 s by default, on every shutdown); none fronts these ports, and in-flight requests still
        # get the deployment's graceful_shutdown_timeout_s to finish.
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
    }


def prepare_ray(cfg) -> None:
    """Before this process starts Ray: set the environment `cfg.ingress` asks for (a variable the user
    set wins). Nothing to do for `ingress: proxy` or when Ray is already running."""
    import ray

    if cfg.ingress != "direct" or ray.is_initialized():
        return
    for key, value in ray_serve_environment(cfg.direct_port).items():
        os.environ.setdefault(key, value)


def direct_urls(app_name: str, host: str, *, timeout: float = 0.0) -> list[str]:
    """Base URLs of `app_name`'s running replicas' own HTTP servers, [] when the Ray instance runs
    without direct ingress (or, after `timeout` seconds, when no replica has started yet). Read from
    the target groups Ray Serve publishes for external load balancers (`serve_target_groups`)."""
    from ray import serve

    deadline = time.time() + timeout
    while True:
        urls = [
            f"http://{host}:{t.port}{g.route_prefix.rstrip('/')}"
            for g in serve_target_groups()
            if g.app_name == app_name and g.ingress_deployment_name and g.protocol == "HTTP"
            for t in g.targets
        ]
        app = serve.status().applications.get(app_name)  # public API
        if urls or time.time() >= deadline or (app is not None and str(app.status).endswith("DEPLOY_FAILED")):
            return sorted(urls)
        time.sleep(0.5)


# The Ray versions `serve_target_groups` was checked on against a running application
# (tests/deploy/test_serve_app.py, which fails on any other version until it is checked there too).
RAY_VERSIONS_CHECKED = ("2.60.0",)


def serve_target_groups() -> list["TargetGroup"]:
    """Ray Serve's target groups (`ray.serve.schema.TargetGroup`, a public schema): per application
    and protocol, the route prefix and each replica's own address. Ray publishes them as
    `ServeInstanceDetails.target_groups` through the dashboard's REST API (GET
    /api/serve/applications/), which a Ray instance started without its dashboard does not serve; the
    controller's client returns the same details in process. That client (`_get_global_client`) is
    private: this function is the one place that reads it, and it parses what it gets with the public
    schema, so a change of shape fails here, by name, rather than as a wrong URL."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import TargetGroup

    details = _get_global_client().get_serve_details()
    return [TargetGroup.model_validate(g) for g in details.get("target_groups", [])]
