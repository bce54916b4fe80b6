"""`drelay serve --config platform/serve/<name>.yaml`: start Ray Serve locally with the application and
block until Ctrl-C / SIGTERM, then shut down gracefully (in-flight requests get
`graceful_shutdown_timeout_s` to finish). The CLI module only wires these two functions."""

from __future__ import annotations

import argparse
import signal
import threading

from drelay_model.errors import DRelayError


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="serve config (platform/serve/*.yaml)")
    parser.add_argument("--host", help="override the config's host")
    parser.add_argument("--port", type=int, help="override the config's port (Ray Serve's proxy)")
    parser.add_argument("--ingress", choices=("direct", "proxy"), help="override the config's ingress")
    parser.add_argument("--direct-port", type=int, help="override the config's direct_port (the first replica's own port)")


def start(cfg, *, name: str = "drelay", route_prefix: str | None = None) -> str:
    """Start (or join) a local Ray cluster and deploy `cfg` as application `name` (at `route_prefix`,
    default the config's) without waiting for it; returns its base URL. Several applications share
    the node's one Serve HTTP proxy (the first one's host and port), each under its own prefix."""
    from ray import serve

    from deploy.serve.app import application
    from deploy.serve.ingress import prepare_ray
    from pipelines.common.ray_start import start_ray

    prepare_ray(cfg)
    start_ray(log_to_driver=False)
    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    prefix = route_prefix or cfg.route_prefix
    serve.run(application(cfg), name=name, route_prefix=prefix, blocking=False)
    return f"http://{cfg.host}:{cfg.port}{prefix.rstrip('/')}"


def _print_direct_urls(cfg) -> None:
    from deploy.serve.ingress import direct_urls

    for direct in direct_urls("drelay", cfg.host, timeout=900):
        print(f"replica direct at {direct}/v1  (no proxy hop)", flush=True)


def run_serve(args: argparse.Namespace) -> int:
    from deploy.serve.config import load_serve_config

    overrides = {
        k: v
        for k, v in (("host", args.host), ("port", args.port), ("ingress", args.ingress), ("direct_port", args.direct_port))
        if v is not None
    }
    cfg = load_serve_config(args.config, overrides)
    if cfg.port in (None, 0):
        raise DRelayError("port: must be set")
    if cfg.backend == "vllm":  # Ray Serve LLM in the vLLM venv: its own process and Ray instance
        from deploy.vllm.serve import run_vllm_serve

        return run_vllm_serve(cfg)
    url = start(cfg)
    print(f"serving '{cfg.model_id}' ({cfg.backend}, method {cfg.method}) at {url}/v1  — Ctrl-C to stop", flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    if cfg.ingress == "direct":  # printed once the replicas are up (model loading takes a while)
        threading.Thread(target=_print_direct_urls, args=(cfg,), daemon=True).start()
    done.wait()
    from ray import serve

    print("shutting down (finishing in-flight requests)…", flush=True)
    serve.shutdown()
    return 0
