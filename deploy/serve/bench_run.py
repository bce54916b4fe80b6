"""`drelay serve-bench`: load-test one endpoint, or two side by side (A, the baseline, then B); results to
MLflow and, on request, a plot of tokens/s against concurrency.

    drelay serve-bench --config platform/serve/smollm2-135m-ar.yaml --config platform/serve/smollm2-135m.yaml \
        --concurrency 1 4 16 32 --requests 32 --max-tokens 64 --plot serve-bench.png
    drelay serve-bench --url http://127.0.0.1:8000 --url http://127.0.0.1:8100 --model smollm2-135m-ar

`--config` (once or twice) starts each config as its own application on the local Ray, both behind the
node's one Serve HTTP proxy (the first config's host and port) under the route prefixes /bench-a and
/bench-b, and removes them afterwards. `--url` (once or twice) loads endpoints that already run (ours, or
any OpenAI-compatible server such as `vllm serve`); `--model`, once per `--url` in the same order, names
the model to ask for (default: the one model the server's /v1/models lists).

Every endpoint answers one short warm-up request first (not counted). Then, level by level, the legs run
in ABBA order (`deploy/serve/bench_pairing.py`); each leg sends max(--requests, C) requests at
concurrency C. Per level it prints tokens/s, latency and TTFT p50/p99, τ and, when paired, B ÷ A of
tokens/s, p99 latency and p99 TTFT, each with its 95% interval over the pairs of legs from 3 rounds on
(`bench_intervals.py`); at the end, all levels as one Markdown table. MLflow: one parent
run (experiment `serve-bench`; the ratios per level with their `_ci_low` / `_ci_high`, step = concurrency) with a child run per endpoint
per level. All input is checked (configs, flags, reachability, the plot's path) before anything runs.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from dataclasses import replace
from urllib.parse import urlsplit

from deploy.serve.bench import LevelResult, load_prompts, run_level
from deploy.serve.bench_intervals import ratio_intervals
from deploy.serve.bench_pairing import TAGS, Endpoint, leg_schedule, level_lines, markdown_table, order_name, ratios, ttft_table
from deploy.serve.bench_plot import check_plot_path, write_plot
from drelay_model.errors import DRelayError


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", action="append", help="serve config to start locally (platform/serve/*.yaml); twice: A then B")
    src.add_argument("--url", action="append", help="an endpoint already running (http://host:port[/prefix]); twice: A then B")
    parser.add_argument("--model", action="append", help="with --url: the model to request, once per --url in order")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--requests", type=int, default=32, help="requests per leg (at least the level's concurrency)")
    parser.add_argument(
        "--rounds", type=int, default=None, help="legs per endpoint per level (default: 2 when paired, ABBA; 1 alone)"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--time-limit", type=float, default=300.0, help="seconds per leg (then no new requests)")
    parser.add_argument("--plot", default=None, help="write a PNG of tokens/s against concurrency (needs matplotlib)")
    parser.add_argument("--experiment", default="serve-bench", help="MLflow experiment")
    parser.add_argument("--run-name", default=None)
    parser.add_argument("--api-key", default=None)


def check_args(args: argparse.Namespace) -> None:
    """The flags alone (no network, no files besides the plot's folder); one line naming the flag."""
    sources = args.config or args.url
    flag = "--config" if args.config else "--url"
    if len(sources) > 2:
        raise DRelayError(f"{flag}: at most two (A, the baseline, then B), got {len(sources)}")
    if any(c < 1 or c > 256 for c in args.concurrency):
        raise DRelayError("--concurrency: each level must be in [1, 256]")
    if len(set(args.concurrency)) != len(args.concurrency):
        raise DRelayError("--concurrency: a level is given twice")
    if args.requests < 1:
        raise DRelayError(f"--requests: must be ≥ 1, got {args.requests}")
    if args.max_tokens < 1:
        raise DRelayError(f"--max-tokens: must be ≥ 1, got {args.max_tokens}")
    if args.time_limit <= 0:
        raise DRelayError(f"--time-limit: must be > 0, got {args.time_limit}")
    if args.rounds is not None and args.rounds < 1:
        raise DRelayError(f"--rounds: must be ≥ 1, got {args.rounds}")
    if args.model and args.config:
        raise DRelayError("--model: goes with --url (a --config names its own model_id)")
    if args.model and len(args.model) != len(args.url):
        raise DRelayError(f"--model: give one per --url, in the same order ({len(args.url)} URLs, {len(args.model)} models)")
    if args.url and len(args.url) == 2 and _same_endpoint(args.url, args.model):
        raise DRelayError(f"--url: A and B are the same endpoint ({args.url[0]}); give two servers (or two --model)")
    if args.config and len(args.config) == 2 and args.config[0] == args.config[1]:
        raise DRelayError(f"--config: A and B are the same file ({args.config[0]}); give two configs")
    check_plot_path(args.plot)


def _same_endpoint(urls: list[str], models: list[str] | None) -> bool:
    a, b = (urlsplit(u.rstrip("/")) for u in urls)
    same_url = (a.scheme, a.hostname, a.port, a.path) == (b.scheme, b.hostname, b.port, b.path)
    return same_url and (models is None or models[0] == models[1])


# ---- endpoints -----------------------------------------------------------------------------------
def load_configs(paths: list[str]):
    """Both configs validated before anything starts (a config's error names its file and field)."""
    from deploy.serve.config import load_serve_config

    cfgs = [load_serve_config(p) for p in paths]
    for path, cfg in zip(paths, cfgs):
        if cfg.backend == "vllm":
            raise DRelayError(f"{path}: backend: 'vllm' runs in its own venv; start it with `drelay serve` and pass --url")
    host, port = cfgs[0].host, cfgs[0].port
    probe = _probe_host(host)
    try:
        with socket.create_connection((probe, port), timeout=1):
            raise DRelayError(f"{paths[0]}: port: {host}:{port} is already in use; stop that server or set a free port")
    except OSError:
        pass  # nothing listens there: free for the Serve proxy
    return cfgs


def start_configs(paths: list[str], cfgs, names: list[str]) -> list[Endpoint]:
    """Deploy each config as its own application (its name appended to `names` as soon as it is
    deployed, for `stop_apps`); wait until each answers /ready."""
    from deploy.serve.commands import start
    from deploy.serve.ingress import direct_urls

    paired = len(cfgs) == 2
    endpoints = []
    for tag, path, cfg in zip(TAGS, paths, cfgs):
        name = f"drelay-bench-{tag.lower()}" if paired else "drelay-bench"
        names.append(name)
        url = start(cfg, name=name, route_prefix=f"/bench-{tag.lower()}" if paired else None)
        endpoints.append(Endpoint(tag, cfg.model_id, url, cfg.model_id, cfg.method, path))
    for i, (e, name, cfg) in enumerate(zip(endpoints, names, cfgs)):
        _wait_ready(e, name)
        # One replica with `ingress: direct`: the load goes to its own port, as a client of that
        # endpoint would send it (no proxy hop); the proxy URL where Ray runs without direct ingress.
        direct = direct_urls(name, _probe_host(cfg.host), timeout=10) if cfg.ingress == "direct" else []
        if len(direct) == 1 and cfg.autoscaling.max_replicas == 1:
            e = endpoints[i] = replace(e, url=direct[0])
        print(f"{e.tag}: {e.label} ({e.method}) ready at {e.url}", file=sys.stderr, flush=True)
    return endpoints


def _probe_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else host


def _wait_ready(endpoint: Endpoint, app_name: str, timeout: float = 900.0) -> None:
    import requests
    from ray import serve

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if requests.get(f"{endpoint.url}/ready", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        app = serve.status().applications.get(app_name)
        if app is not None and str(app.status).endswith("DEPLOY_FAILED"):
            lines = [line for line in (app.message or "").splitlines() if line.strip()]
            raise DRelayError(f"{endpoint.source}: the endpoint failed to start: {lines[-1] if lines else 'DEPLOY_FAILED'}")
        time.sleep(1)
    raise DRelayError(f"{endpoint.source}: the endpoint at {endpoint.url} was not ready after {timeout:.0f} s")


def stop_apps(names: list[str]) -> None:
    """Remove the benchmark's applications; stop Serve when nothing else runs on it."""
    import ray
    from ray import serve

    if not names or not ray.is_initialized():
        return
    for name in names:
        serve.delete(name)
    if not serve.status().applications:
        serve.shutdown()


def probe_urls(urls: list[str], models: list[str] | None, api_key: str | None) -> list[Endpoint]:
    """Each URL must answer GET /v1/models and serve the model asked for (or exactly one)."""
    import requests

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    endpoints = []
    for i, (tag, url) in enumerate(zip(TAGS, urls)):
        url = url.rstrip("/")
        try:
            r = requests.get(f"{url}/v1/models", headers=headers, timeout=10)
            served = {m["id"]: m.get("method", "external") for m in r.json()["data"]} if r.status_code == 200 else None
        except requests.RequestException as exc:
            raise DRelayError(f"--url: {url} is unreachable ({type(exc).__name__})") from None
        except (ValueError, KeyError, TypeError):
            raise DRelayError(f"--url: {url}/v1/models is not an OpenAI model list") from None
        if served is None:
            raise DRelayError(f"--url: {url}/v1/models answered HTTP {r.status_code}")
        model = models[i] if models else None
        if model is None and len(served) != 1:
            raise DRelayError(f"--model: {url} serves {sorted(served)}; name one per --url")
        model = model or next(iter(served))
        if model not in served:
            raise DRelayError(f"--model: '{model}' is not served at {url} (it serves {sorted(served)})")
        endpoints.append(Endpoint(tag, model, url, model, served[model], url))
    if len(endpoints) == 2 and (endpoints[0].url, endpoints[0].model) == (endpoints[1].url, endpoints[1].model):
        raise DRelayError(f"--url: A and B are the same endpoint ({endpoints[0].url}, model {endpoints[0].model})")
    return endpoints


# ---- the run -------------------------------------------------------------------------------------
def run_bench(args: argparse.Namespace, bootstrap: dict[str, int] | None = None) -> int:
    """The command; `bootstrap`: the B ÷ A intervals' `resamples` and `seed` (`bench_intervals.py`)."""
    check_args(args)
    names: list[str] = []
    if args.config:
        cfgs = load_configs(args.config)
        try:
            endpoints = start_configs(args.config, cfgs, names)
            targets = [c.engine.target if c.backend == "engine" else c.sglang.model_path for c in cfgs]
            return _measure(args, endpoints, targets, bootstrap or {})
        finally:
            stop_apps(names)
    endpoints = probe_urls(args.url, args.model, args.api_key)
    return _measure(args, endpoints, [e.model for e in endpoints], bootstrap or {})


def _measure(args: argparse.Namespace, endpoints: list[Endpoint], targets: list[str], bootstrap: dict[str, int]) -> int:
    from pipelines.common.run_tags import run_tags
    from pipelines.common.tracking import tracked_run

    rounds = args.rounds or (2 if len(endpoints) == 2 else 1)
    prompts = load_prompts(max(args.requests, max(args.concurrency)) * rounds)
    for e in endpoints:  # first-call costs (allocations, weight packing) stay out of the numbers
        run_level(e.url, e.model, prompts, concurrency=1, requests_n=1, max_tokens=min(8, args.max_tokens),
                  time_limit=args.time_limit, api_key=args.api_key)  # fmt: skip
    params = {"requests_per_leg": args.requests, "max_tokens": args.max_tokens, "time_limit_per_leg": args.time_limit,
              "rounds": rounds, "order": order_name(len(endpoints), rounds), "concurrency": " ".join(map(str, args.concurrency)),
              **({f"bootstrap_{k}": v for k, v in bootstrap.items()} if len(endpoints) == 2 else {})}  # fmt: skip
    for e in endpoints:
        params.update(
            {f"{e.tag}_url": e.url, f"{e.tag}_model": e.model, f"{e.tag}_method": e.method, f"{e.tag}_source": e.source}
        )
    tags = run_tags("serve-bench", target=",".join(dict.fromkeys(targets)), method=",".join(e.method for e in endpoints))
    default_name = "serve-bench-" + "-vs-".join(e.label for e in endpoints)
    levels = []
    with tracked_run(args.experiment, run_name=args.run_name or default_name, params=params, tags=tags) as run:
        for c in args.concurrency:
            rows, legs = _run_level_legs(args, endpoints, prompts, c, rounds)
            level_ratios = {**ratios(*rows), **ratio_intervals(*legs, **bootstrap)} if len(rows) == 2 else None
            levels.append((rows, level_ratios))
            _log_level(run, endpoints, rows, level_ratios)
            print("\n".join(level_lines(rows, endpoints, level_ratios)), flush=True)
        run.log_table([{"endpoint": e.tag, "label": e.label, **r} for rows, _ in levels for e, r in zip(endpoints, rows)],
                      "serve_bench.json")  # fmt: skip
        if len(endpoints) == 2:
            run.log_table([{"concurrency": rows[0]["concurrency"], **rat} for rows, rat in levels], "serve_bench_ratios.json")
        print("\n" + markdown_table(levels, endpoints), flush=True)
        breakdown = ttft_table(levels, endpoints)
        if breakdown is not None:
            print("\nTime to first token, in parts (the engine's queue wait, prefill and first round; serving: the rest)\n"
                  + breakdown, flush=True)  # fmt: skip
        if args.plot:
            write_plot(args.plot, levels, endpoints)
            run.log_artifact(args.plot)
            print(f"plot: {args.plot}", flush=True)
    return 0


def _run_level_legs(
    args, endpoints: list[Endpoint], prompts: list[str], c: int, rounds: int
) -> tuple[list[dict], list[list[LevelResult]]]:
    """Every leg of level `c` in ABBA order: one merged summary per endpoint, and each endpoint's legs in
    round order (leg r of A and of B asked the same prompts)."""
    per_leg = max(args.requests, c)
    legs: list[list[LevelResult]] = [[] for _ in endpoints]
    for leg in leg_schedule([c], len(endpoints), rounds):
        e = endpoints[leg.endpoint]
        print(f"  c={c} round {leg.round + 1}/{rounds}: {e.tag} {e.label}", file=sys.stderr, flush=True)
        result = run_level(e.url, e.model, prompts, concurrency=c, requests_n=per_leg, max_tokens=args.max_tokens,
                           time_limit=args.time_limit, api_key=args.api_key, prompt_offset=leg.round * per_leg)  # fmt: skip
        legs[leg.endpoint].append(result)
    return [{**LevelResult.merged(x).summary(), "legs": len(x)} for x in legs], legs


def _log_level(run, endpoints: list[Endpoint], rows: list[dict], level_ratios: dict | None) -> None:
    """A child run per endpoint; on the parent each endpoint's numbers and the ratios, step = concurrency."""
    c = rows[0]["concurrency"]
    paired = len(endpoints) == 2
    for e, row in zip(endpoints, rows):
        name = f"{e.tag}-{e.label}-c{c}" if paired else f"c{c}"
        with run.child(name, params={"endpoint": e.tag, "model": e.model, "method": e.method, "concurrency": c}) as child:
            child.log_metrics(row)
        prefix = f"{e.tag}_" if paired else ""
        run.log_metrics({prefix + k: v for k, v in row.items() if k != "concurrency"}, step=c)
    if level_ratios is not None:
        run.log_metrics(level_ratios, step=c)
