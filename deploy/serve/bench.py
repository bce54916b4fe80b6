"""`drelay serve-bench`: a bounded load generator for an OpenAI-compatible endpoint, results to MLflow.

    drelay serve-bench --config platform/serve/smollm2-135m.yaml --concurrency 1 4 16 32 \
        --requests 32 --max-tokens 64 --time-limit 300

At each concurrency level C, C client threads send streamed chat requests (GSM8K test questions,
greedy) until `--requests` have been sent or `--time-limit` seconds have passed; each level reports
  throughput   completion tokens / wall seconds of the level;  req_per_s
  latency      p50 / p99 of arrival → last byte;  ttft  p50 / p99 of arrival → first content
  tau          mean of the responses' tokens per verification round (sglext)
  failures     requests that got no 200 or an in-band error; status counts by code
With `--config` the command starts the app itself (local Ray) and stops it afterwards; with `--url`
it loads an endpoint that is already running. One MLflow run per invocation, one child per level.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from drelay_model.errors import DRelayError

PROMPTS = Path(__file__).resolve().parents[2] / "data" / "benchmarks" / "gsm8k" / "test.jsonl"


@dataclass
class Sample:
    status: int
    latency: float = 0.0
    ttft: float = 0.0
    tokens: int = 0
    tau: float | None = None


@dataclass
class LevelResult:
    concurrency: int
    wall_s: float
    samples: list[Sample] = field(default_factory=list)

    def summary(self) -> dict[str, float]:
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
            "latency_p50_s": _pct(lat, 50),
            "latency_p99_s": _pct(lat, 99),
            "ttft_p50_s": _pct(ttft, 50),
            "ttft_p99_s": _pct(ttft, 99),
            "tau_mean": statistics.fmean(taus) if taus else 0.0,
        }
        for code in sorted({s.status for s in self.samples}):
            out[f"status_{code}"] = sum(s.status == code for s in self.samples)
        return out


def _pct(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    i = min(len(sorted_values) - 1, max(0, round(q / 100 * len(sorted_values) + 0.5) - 1))
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
            sample.latency = time.perf_counter() - t0
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
) -> LevelResult:
    lock, sent, samples = threading.Lock(), [0], []
    deadline = time.perf_counter() + time_limit

    def worker() -> None:
        while time.perf_counter() < deadline:
            with lock:
                if sent[0] >= requests_n:
                    return
                i = sent[0]
                sent[0] += 1
            s = one_request(url, model, prompts[i % len(prompts)], max_tokens, api_key)
            with lock:
                samples.append(s)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(worker) for _ in range(concurrency)]:
            f.result()
    return LevelResult(concurrency=concurrency, wall_s=time.perf_counter() - t0, samples=samples)


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", help="serve config to start locally for the benchmark (platform/serve/*.yaml)")
    src.add_argument("--url", help="an endpoint that is already running (http://host:port)")
    parser.add_argument("--model", help="model id (default: the config's model_id)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--time-limit", type=float, default=300.0, help="seconds per level (then no new requests)")
    parser.add_argument("--experiment", default="serve-bench", help="MLflow experiment")
    parser.add_argument("--run-name", default=None)
    parser.add_argument("--api-key", default=None)


def _check(args) -> None:
    if any(c < 1 or c > 256 for c in args.concurrency):
        raise DRelayError("--concurrency: each level must be in [1, 256]")
    if args.requests < 1 or args.max_tokens < 1 or args.time_limit <= 0:
        raise DRelayError("--requests and --max-tokens must be ≥ 1, --time-limit > 0")
    if args.url is None and args.model is not None:
        raise DRelayError("--model goes with --url (a --config names its own model_id)")
    if args.url is not None and args.model is None:
        raise DRelayError("--url needs --model")


def run_bench(args: argparse.Namespace) -> int:
    from pipelines.common.tracking import tracked_run

    _check(args)
    cfg = None
    if args.config:
        from deploy.serve.commands import start
        from deploy.serve.config import load_serve_config

        cfg = load_serve_config(args.config)
        url, model = start(cfg, name="drelay-bench"), cfg.model_id
        _wait_ready(url)
    else:
        url, model = args.url.rstrip("/"), args.model
    prompts = load_prompts(max(args.requests, 1))
    params = {
        "url": url,
        "model": model,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "time_limit": args.time_limit,
        "method": cfg.method if cfg else "unknown",
        "config": args.config or "",
    }
    rows = []
    try:
        with tracked_run(args.experiment, run_name=args.run_name or f"serve-bench-{model}", params=params) as run:
            for c in args.concurrency:
                level = run_level(
                    url,
                    model,
                    prompts,
                    concurrency=c,
                    requests_n=args.requests,
                    max_tokens=args.max_tokens,
                    time_limit=args.time_limit,
                    api_key=args.api_key,
                )
                row = level.summary()
                rows.append(row)
                with run.child(f"c{c}") as child:
                    child.log_metrics(row)
                run.log_metrics({k: v for k, v in row.items() if k != "concurrency"}, step=c)
                print(json.dumps(row), flush=True)
            run.log_table(rows, "serve_bench.json")
    finally:
        if cfg is not None:
            from ray import serve

            serve.shutdown()
    return 0


def _wait_ready(url: str, timeout: float = 600.0) -> None:
    import requests

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if requests.get(f"{url}/ready", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1)
    raise DRelayError(f"the endpoint at {url} was not ready after {timeout:.0f} s")
