"""The serving path's Prometheus metrics, recorded once and exported twice:

- through Ray Serve's metrics API (`ray.serve.metrics`), on each node's Ray metrics export port next to
  Ray Serve's own `ray_serve_*` series: Ray prefixes the names with `ray_` and adds the tags
  `deployment`, `replica` and `application`;
- on the app's own `GET /metrics` (Prometheus text format, `prometheus_client`): the series of the
  replica that answers, under the names below.

Counters carry the `_total` suffix in both exports. Every series is labelled by `method` (ar, native,
drelay, ...); per-request series also by `route` (chat, completions). `SERIES` is the list
(docs/serving.md, "Metrics", shows it as a table with a sample scrape).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

from deploy.serve.backends.base import SpecStats

_LATENCY_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
_PER_TOKEN_S = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2)
_TAU = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0, 16.0)
# Integer counts: bucket le = n + 0.5 holds the observations ≤ n (Ray's buckets must be positive).
_DRAFTS = tuple(n + 0.5 for n in (*range(17), 24, 32, 48, 63))
_BATCH = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)

REQUEST = ("method", "route")
ENGINE = ("method",)


@dataclass(frozen=True)
class Series:
    """One metric: its Prometheus name (counters without `_total`, which both exports add), type, unit,
    labels, meaning (ASCII: Ray's metrics take no other), and for a histogram its bucket bounds."""

    name: str
    kind: str  # counter | gauge | histogram
    unit: str
    labels: tuple[str, ...]
    help: str
    buckets: tuple[float, ...] = ()


SERIES = (
    Series("drelay_time_to_first_token_seconds", "histogram", "s", REQUEST, "request arrival to its first token", _LATENCY_S),
    Series("drelay_e2e_request_latency_seconds", "histogram", "s", REQUEST, "request arrival to its last token", _LATENCY_S),
    Series("drelay_time_per_output_token_seconds", "histogram", "s", REQUEST,
           "per request: (last token - first token) / (tokens - 1)", _PER_TOKEN_S),
    Series("drelay_request_queue_time_seconds", "histogram", "s", REQUEST, "engine: submitted to its prefill starts", _LATENCY_S),
    Series("drelay_request_prefill_time_seconds", "histogram", "s", REQUEST, "engine: the request's prefill", _LATENCY_S),
    Series("drelay_requests", "counter", "requests", (*REQUEST, "status"), "finished requests by HTTP status"),
    Series("drelay_prompt_tokens", "counter", "tokens", REQUEST, "prompt tokens of finished requests"),
    Series("drelay_generation_tokens", "counter", "tokens", REQUEST, "generated tokens"),
    Series("drelay_spec_rounds", "counter", "rounds", REQUEST, "verification rounds (target forwards after prefill)"),
    Series("drelay_spec_drafted_rounds", "counter", "rounds", REQUEST,
           "rounds that verified drafts (the rest: AR rounds chosen by the cost-aware length; engine only)"),
    Series("drelay_spec_verified_drafts", "counter", "tokens", REQUEST, "drafts submitted for verification"),
    Series("drelay_spec_accepted_drafts", "counter", "tokens", REQUEST, "drafts accepted and committed"),
    Series("drelay_spec_tokens_per_round", "histogram", "tokens", REQUEST, "tau of each request: tokens per round", _TAU),
    Series("drelay_spec_accepted_drafts_per_round", "histogram", "tokens", ENGINE,
           "drafts accepted by each verification round", _DRAFTS),
    Series("drelay_num_requests_running", "gauge", "requests", ENGINE, "requests decoding now (rows of the batch)"),
    Series("drelay_num_requests_waiting", "gauge", "requests", ENGINE, "requests queued for admission"),
    Series("drelay_batch_size", "histogram", "requests", ENGINE, "rows of each engine step's round", _BATCH),
)  # fmt: skip


class _Sinks:
    """One series in both exports: Ray Serve's metric and a `prometheus_client` one in `registry`."""

    def __init__(self, series: Series, registry, method: str) -> None:
        import prometheus_client as prom
        from ray.serve import metrics as ray_metrics

        kw = {"description": series.help, "tag_keys": series.labels}
        if series.kind == "histogram":
            self.ray = ray_metrics.Histogram(series.name, boundaries=list(series.buckets), **kw)
            self.prom = prom.Histogram(series.name, series.help, series.labels, buckets=series.buckets, registry=registry)
        elif series.kind == "counter":
            self.ray = ray_metrics.Counter(series.name, **kw)
            self.prom = prom.Counter(series.name, series.help, series.labels, registry=registry)
        else:
            self.ray = ray_metrics.Gauge(series.name, **kw)
            self.prom = prom.Gauge(series.name, series.help, series.labels, registry=registry)
        self.kind, self.method = series.kind, method

    def record(self, value: float, **tags: str) -> None:
        tags = {"method": self.method, **tags}
        if self.kind == "histogram":
            self.ray.observe(value, tags=tags)
            self.prom.labels(**tags).observe(value)
        elif self.kind == "counter":
            if value > 0:  # Ray's counters take positive increments only
                self.ray.inc(value, tags=tags)
            self.prom.labels(**tags).inc(value)
        else:
            self.ray.set(value, tags=tags)
            self.prom.labels(**tags).set(value)


class ServeMetrics:
    """A replica's metrics (`SERIES`): requests record as they finish, the engine's load and batch
    sizes are sampled (`sample`, every `interval_s` by `start_sampling`, and at each scrape)."""

    def __init__(self, method: str) -> None:
        import prometheus_client as prom

        self.registry = prom.CollectorRegistry(auto_describe=True)  # this replica's own, for GET /metrics
        self.series = {s.name: _Sinks(s, self.registry, method) for s in SERIES}
        self._sample_lock = threading.Lock()
        self._stop = threading.Event()

    def _record(self, name: str, value: float, **tags: str) -> None:
        self.series[name].record(value, **tags)

    def finished(
        self, route: str, *, latency: float, ttft: float, prompt_tokens: int, tokens: int, spec: SpecStats | None
    ) -> None:
        """A request answered with status 200: its latencies, tokens and speculative statistics."""
        self._record("drelay_e2e_request_latency_seconds", latency, route=route)
        self._record("drelay_time_to_first_token_seconds", ttft, route=route)
        if tokens > 1 and latency > ttft:
            self._record("drelay_time_per_output_token_seconds", (latency - ttft) / (tokens - 1), route=route)
        self._record("drelay_requests", 1, route=route, status="200")
        self._record("drelay_prompt_tokens", prompt_tokens, route=route)
        self._record("drelay_generation_tokens", tokens, route=route)
        if spec is not None:
            self._spec(route, spec)

    def _spec(self, route: str, spec: SpecStats) -> None:
        if spec.ttft_parts is not None:
            queue, prefill, _ = spec.ttft_parts
            self._record("drelay_request_queue_time_seconds", queue, route=route)
            self._record("drelay_request_prefill_time_seconds", prefill, route=route)
        if not spec.verify_ct:
            return
        accepted = sum(n * count for n, count in enumerate(spec.accept_histogram))
        self._record("drelay_spec_rounds", spec.verify_ct, route=route)
        self._record("drelay_spec_accepted_drafts", accepted, route=route)
        if spec.drafted_ct:  # None: the backend does not say (SGLang); 0: every round was AR
            self._record("drelay_spec_drafted_rounds", spec.drafted_ct, route=route)
            self._record("drelay_spec_verified_drafts", spec.verified_drafts, route=route)
        # τ = tokens committed per round: every round commits its accepted drafts + one target token
        self._record("drelay_spec_tokens_per_round", (accepted + spec.verify_ct) / spec.verify_ct, route=route)
        for n, count in enumerate(spec.accept_histogram):  # one observation per round
            for _ in range(count):
                self._record("drelay_spec_accepted_drafts_per_round", n)

    def failed(self, route: str, status: int) -> None:
        self._record("drelay_requests", 1, route=route, status=str(status))

    # ---- the engine, sampled -------------------------------------------------------------------
    def sample(self, load: dict[str, int], batch_sizes: Iterable[int]) -> None:
        """The backend's load now ({'running', 'waiting'}) and its steps' batch sizes since the last call."""
        with self._sample_lock:
            self._record("drelay_num_requests_running", load.get("running", 0))
            self._record("drelay_num_requests_waiting", load.get("waiting", 0))
            for rows in batch_sizes:
                self._record("drelay_batch_size", rows)

    def start_sampling(self, backend, interval_s: float = 1.0) -> None:
        """Sample `backend` (its `load()` and `drain_batch_sizes()`) every `interval_s` on a daemon
        thread until `stop_sampling`."""

        def loop() -> None:
            while not self._stop.wait(interval_s):
                self.sample(backend.load(), backend.drain_batch_sizes())

        threading.Thread(target=loop, name="drelay-metrics", daemon=True).start()

    def stop_sampling(self) -> None:
        self._stop.set()

    def render(self) -> tuple[bytes, str]:
        """This replica's series in Prometheus text format, and its content type."""
        import prometheus_client as prom

        return prom.generate_latest(self.registry), prom.CONTENT_TYPE_LATEST
