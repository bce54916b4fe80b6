"""The load generator of `drelay serve-bench`: streamed greedy chat requests against an OpenAI-compatible
endpoint, timed from the client's side (the command itself: `deploy/serve/bench_run.py`).

One leg at concurrency C: C client threads send requests (GSM8K test questions) until `requests` have
been sent or `time_limit` seconds have passed. A level's result merges its legs and reports
  throughput   completion tokens / wall seconds of its legs;  req_per_s
  latency      p50 / p99 of send → last byte;  ttft  p50 / p99 of send → first content
  tau          mean of the responses' tokens per verification round (SGLang's sglext, or vLLM's
               per-request `metrics.speculative_decoding.mean_acceptance_length`; absent elsewhere)
  failures     requests that got no 200 or an in-band error; status counts by code
  TTFT parts   p50 / p99 of the engine's split of its time to first token (our `sglext`: queue wait,
               prefill, first round) and of the rest of the client's TTFT (serving: HTTP, rendering
               the prompt, streaming); None for servers that do not report the split
"""

from __future__ import annotations

import json
import math
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

PROMPTS = Path(__file__).resolve().parents[2] / "data" / "benchmarks" / "gsm8k" / "test.jsonl"
# the client's TTFT in parts: the engine's own (sglext keys, deploy/serve/backends/base.py) and the rest
TTFT_PARTS = {"queue": "queue_time_s", "prefill": "prefill_time_s", "first_round": "first_round_time_s"}


@dataclass
class Sample:
    status: int
    latency: float = 0.0
    ttft: float = 0.0
    tokens: int = 0
    tau: float | None = None
    ttft_parts: dict[str, float] | None = None  # TTFT_PARTS' keys + "serving" (the client's TTFT − the engine's)


@dataclass
class LevelResult:
    concurrency: int
    wall_s: float
    samples: list[Sample] = field(default_factory=list)

    @classmethod
    def merged(cls, legs: list["LevelResult"]) -> "LevelResult":
        """One level from its legs (same concurrency): samples pooled, wall seconds summed."""
        assert legs and len({leg.concurrency for leg in legs}) == 1, "legs of one level"
        return cls(legs[0].concurrency, sum(leg.wall_s for leg in legs), [s for leg in legs for s in leg.samples])

    def summary(self) -> dict[str, float | None]:
        ok = [s for s in self.samples if s.status == 200]
        lat, ttft = sorted(s.latency for s in ok), sorted(s.ttft for s in ok)
        taus = [s.tau for s in ok if s.tau is not None]
        tokens = sum(s.tokens for s in ok)
        out = {
            "concurrency": self.concurrency,
            "requests": len(self.samples),
            "failures": len(self.samples) - len(ok),
            "wall_s": self.wall_s,
            "tokens_per_s": tokens / self.wall_s if self.wall_s else 0.0,
            "req_per_s": len(ok) / self.wall_s if self.wall_s else 0.0,
            "latency_p50_s": percentile(lat, 50),
            "latency_p99_s": percentile(lat, 99),
            "ttft_p50_s": percentile(ttft, 50),
            "ttft_p99_s": percentile(ttft, 99),
            "tau_mean": statistics.fmean(taus) if taus else None,  # None: the server reports no sglext
        }
        split = [s.ttft_parts for s in ok if s.ttft_parts is not None]
        for part in (*TTFT_PARTS, "serving"):
            values = sorted(p[part] for p in split)
            out[f"{part}_p50_s"], out[f"{part}_p99_s"] = (
                (percentile(values, 50), percentile(values, 99)) if values else (None, None)
            )
        for code in sorted({s.status for s in self.samples}):
            out[f"status_{code}"] = sum(s.status == code for s in self.samples)
        return out


def percentile(sorted_values: list[float], q: float) -> float:
    """The nearest-rank q-th percentile: the smallest value with at least q% of the values ≤ it."""
    if not sorted_values:
        return 0.0
    i = min(len(sorted_values) - 1, max(0, math.ceil(q / 100 * len(sorted_values)) - 1))
    return sorted_values[i]


def load_prompts(n: int) -> list[str]:
    with PROMPTS.open() as f:
        return [json.loads(line)["question"] for line, _ in zip(f, range(n))]


def one_request(url: str, model: str, prompt: str, max_tokens: int, api_key: str | None) -> Sample:
    """A streamed greedy chat request; timings from the client's side."""
    import requests

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},  # vLLM sends usage only when asked
        "return_spec_tokens_details": True,
    }
    t0 = time.perf_counter()
    try:
        with requests.post(f"{url}/v1/chat/completions", json=body, headers=headers, stream=True, timeout=600) as r:
            if r.status_code != 200:
                return Sample(status=r.status_code, latency=time.perf_counter() - t0)
            sample = Sample(status=200)
            for line in r.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    sample.status = 500
                if sample.ttft == 0.0 and any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                    sample.ttft = time.perf_counter() - t0
                if event.get("usage"):
                    sample.tokens = event["usage"]["completion_tokens"]
                    ext = event.get("sglext")
                    if ext and ext["spec_verify_ct"]:
                        sample.tau = (sample.tokens - 1) / ext["spec_verify_ct"]
                    if ext and all(k in ext for k in TTFT_PARTS.values()):
                        sample.ttft_parts = {part: float(ext[k]) for part, k in TTFT_PARTS.items()}
                spec = (event.get("metrics") or {}).get("speculative_decoding")  # vLLM, with per-request spec metrics
                if spec and spec.get("num_spec_steps"):
                    sample.tau = spec["mean_acceptance_length"]
            sample.latency = time.perf_counter() - t0
            if sample.ttft_parts is not None:
                sample.ttft_parts["serving"] = max(sample.ttft - sum(sample.ttft_parts.values()), 0.0)
            return sample
    except requests.RequestException:
        return Sample(status=599, latency=time.perf_counter() - t0)


def run_level(
    url: str,
    model: str,
    prompts: list[str],
    *,
    concurrency: int,
    requests_n: int,
    max_tokens: int,
    time_limit: float,
    api_key: str | None,
    prompt_offset: int = 0,
) -> LevelResult:
    """One leg: `concurrency` client threads until `requests_n` were sent or `time_limit` passed;
    request i asks prompt `prompt_offset + i` (the same prompts for both endpoints of a pair)."""
    lock, sent, samples = threading.Lock(), [0], []
    deadline = time.perf_counter() + time_limit

    def worker() -> None:
        while time.perf_counter() < deadline:
            with lock:
                if sent[0] >= requests_n:
                    return
                i = sent[0]
                sent[0] += 1
            s = one_request(url, model, prompts[(prompt_offset + i) % len(prompts)], max_tokens, api_key)
            with lock:
                samples.append(s)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(worker) for _ in range(concurrency)]:
            f.result()
    return LevelResult(concurrency=concurrency, wall_s=time.perf_counter() - t0, samples=samples)
