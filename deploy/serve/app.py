"""The Ray Serve application: an OpenAI-compatible ingress over one backend per replica.

    serve run deploy.serve.app:build_app config=platform/serve/smollm2-135m.yaml
    drelay serve --config platform/serve/smollm2-135m.yaml            (deploy/serve/commands.py)

Routes: POST /v1/chat/completions, POST /v1/completions (SSE when `stream: true`), GET /v1/models,
GET /health (the replica is alive), GET /ready (the backend has loaded and its driver runs), GET /metrics
(this replica's Prometheus series, deploy/serve/metrics.py; also on Ray's metrics export port).
"""

import logging
import os

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from deploy.serve.config import ServeConfig, load_serve_config, parse_config
from deploy.serve.protocol import ApiError

log = logging.getLogger(__name__)
api = FastAPI(title="DRelay OpenAI-compatible server")


def make_backend(cfg: ServeConfig):
    if cfg.backend == "engine":
        from deploy.serve.backends.engine import EngineBackend

        # Threads: `engine.threads`, else the engine's auto policy (drelay_model/kernels/threads.py:
        # the cores of this process's affinity other processes leave free), never Ray's
        # OMP_NUM_THREADS = the replica's `num_cpus`.
        return EngineBackend(cfg.engine, cfg.limits)
    from deploy.serve.backends.sglang import SGLangBackend

    return SGLangBackend(cfg.sglang, cfg.limits)


def _error(exc: ApiError, metrics, route: str) -> JSONResponse:
    if metrics is not None and route:
        metrics.failed(route, exc.status)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


@serve.deployment
@serve.ingress(api)
class OpenAIServer:
    """One replica: loads the backend once, answers the OpenAI routes."""

    def __init__(self, config: dict) -> None:
        from deploy.serve.metrics import ServeMetrics
        from deploy.serve.service import Service

        cfg = parse_config(config)
        key = os.environ.get(cfg.auth.api_key_env, "") if cfg.auth.api_key_env else ""
        self.backend = make_backend(cfg)
        self.metrics = ServeMetrics(cfg.method)
        self.metrics.start_sampling(self.backend)
        self.service = Service(cfg, self.backend, api_key=key or None, metrics=self.metrics)

    @api.get("/health")
    async def health(self) -> dict:
        return {"status": "ok", "pid": os.getpid(), **self.backend.threads()}

    @api.get("/ready")
    async def ready(self):
        ok = self.backend.ready()
        return JSONResponse({"ready": ok, **self.backend.load()}, status_code=200 if ok else 503)

    @api.get("/metrics")
    async def metrics_text(self) -> Response:
        """This replica's series in Prometheus text format (deploy/serve/metrics.py), sampled now."""
        self.metrics.sample(self.backend.load(), self.backend.drain_batch_sizes())
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)

    @api.get("/v1/models")
    async def models(self, request: Request):
        try:
            self.service.check_auth(request.headers.get("authorization"))
        except ApiError as exc:
            return _error(exc, None, "")
        return self.service.models()

    @api.post("/v1/chat/completions")
    async def chat(self, request: Request):
        return await self._generate("chat", request)

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._generate("completions", request)

    async def _generate(self, route: str, request: Request):
        try:
            self.service.check_auth(request.headers.get("authorization"))
            out = await self.service.generate(route, await request.body())
        except ApiError as exc:
            return _error(exc, self.metrics, route)
        except Exception as exc:  # never a traceback to the client
            log.exception("request failed")
            return _error(ApiError(500, f"internal error: {type(exc).__name__}", type="server_error"), self.metrics, route)
        if isinstance(out, dict):
            return out
        return StreamingResponse(out, media_type="text/event-stream")

    def __del__(self) -> None:
        if getattr(self, "metrics", None) is not None:
            self.metrics.stop_sampling()
        backend = getattr(self, "backend", None)
        if backend is not None:
            backend.shutdown()


def deployment_options(cfg: ServeConfig) -> dict:
    """Ray Serve deployment options from a serve config (replicas, queue bounds, resources)."""
    a = cfg.autoscaling
    opts = {
        "name": "drelay",
        "max_ongoing_requests": cfg.max_ongoing_requests,
        "max_queued_requests": cfg.max_queued_requests,
        "graceful_shutdown_timeout_s": cfg.graceful_shutdown_timeout_s,
        "graceful_shutdown_wait_loop_s": 1.0,
        "ray_actor_options": {"num_cpus": cfg.num_cpus, "num_gpus": cfg.num_gpus},
    }
    if a.min_replicas == a.max_replicas:
        opts["num_replicas"] = a.max_replicas
    else:
        opts["autoscaling_config"] = {
            "min_replicas": a.min_replicas,
            "max_replicas": a.max_replicas,
            "initial_replicas": max(a.min_replicas, 1),
            "target_ongoing_requests": a.target_ongoing_requests,
            "upscale_delay_s": a.upscale_delay_s,
            "downscale_delay_s": a.downscale_delay_s,
        }
    return opts


def application(cfg: ServeConfig):
    """The bound application for a validated config."""
    return OpenAIServer.options(**deployment_options(cfg)).bind(cfg.model_dump())


def build_app(args: dict):
    """`serve run deploy.serve.app:build_app config=<yaml>` entry point."""
    if "config" not in args:
        raise ValueError("pass config=<path to a platform/serve/*.yaml file>")
    return application(load_serve_config(args["config"]))
