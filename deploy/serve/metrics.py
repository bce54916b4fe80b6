"""Per-request serving metrics, exported through Ray Serve's metrics (Prometheus format on each node's
metrics port, next to Ray Serve's own `ray_serve_*` series). Every series is tagged by `method`
(ar, native, drelay, ...) and `route` (chat, completions).

    drelay_request_latency_s       histogram   request wall time, arrival → last token
    drelay_time_to_first_token_s   histogram   arrival → first token
    drelay_tokens_per_s            histogram   completion tokens / (last token − first token)
    drelay_tau                     histogram   tokens committed per verification round, per request
    drelay_requests                counter     finished requests, tagged also by `status` (HTTP code)
    drelay_completion_tokens       counter     generated tokens
    drelay_spec_rounds             counter     verification rounds (target forwards after the prefill)
    drelay_spec_drafted_rounds     counter     rounds that verified drafts (the rest: AR rounds chosen
                                               by the cost-aware length; engine backend only)
    drelay_spec_verified_drafts    counter     drafts verified by those rounds: the mean verification
                                               length is rate(verified_drafts) / rate(drafted_rounds)
"""

from __future__ import annotations

from ray.serve import metrics

_TAGS = ("method", "route")
_LATENCY = [0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128]
_RATE = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000]
_TAU = [1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0, 16.0]


class ServeMetrics:
    def __init__(self, method: str) -> None:
        self.method = method
        self.latency = metrics.Histogram(
            "drelay_request_latency_s", description="request latency (s)", boundaries=_LATENCY, tag_keys=_TAGS
        )
        self.ttft = metrics.Histogram(
            "drelay_time_to_first_token_s", description="time to first token (s)", boundaries=_LATENCY, tag_keys=_TAGS
        )
        self.rate = metrics.Histogram(
            "drelay_tokens_per_s", description="decode tokens per second per request", boundaries=_RATE, tag_keys=_TAGS
        )
        self.tau = metrics.Histogram(
            "drelay_tau", description="tokens per verification round per request", boundaries=_TAU, tag_keys=_TAGS
        )
        self.requests = metrics.Counter(
            "drelay_requests", description="finished requests by HTTP status", tag_keys=(*_TAGS, "status")
        )
        self.tokens = metrics.Counter("drelay_completion_tokens", description="generated tokens", tag_keys=_TAGS)
        self.rounds = metrics.Counter("drelay_spec_rounds", description="verification rounds", tag_keys=_TAGS)
        self.drafted = metrics.Counter("drelay_spec_drafted_rounds", description="rounds that verified drafts", tag_keys=_TAGS)
        self.verified = metrics.Counter(
            "drelay_spec_verified_drafts", description="drafts verified by drafted rounds", tag_keys=_TAGS
        )

    def finished(
        self, route: str, *, latency: float, ttft: float, tokens: int, tau: float | None,
        rounds: int = 0, drafted_rounds: int | None = None, verified_drafts: int = 0,
    ) -> None:  # fmt: skip
        tags = {"method": self.method, "route": route}
        if rounds:
            self.rounds.inc(rounds, tags=tags)
        if drafted_rounds:  # None: the backend does not say (SGLang); 0: every round was AR
            self.drafted.inc(drafted_rounds, tags=tags)
        if verified_drafts:
            self.verified.inc(verified_drafts, tags=tags)
        self.latency.observe(latency, tags=tags)
        self.ttft.observe(ttft, tags=tags)
        if tokens > 1 and latency > ttft:
            self.rate.observe((tokens - 1) / (latency - ttft), tags=tags)
        if tau is not None:
            self.tau.observe(tau, tags=tags)
        self.tokens.inc(tokens, tags=tags)
        self.requests.inc(tags={**tags, "status": "200"})

    def failed(self, route: str, status: int) -> None:
        self.requests.inc(tags={"method": self.method, "route": route, "status": str(status)})
