"""The OpenAI-compatible app on a real Ray Serve instance (127.0.0.1), driven by the official `openai`
client: chat and completions, streamed and not, greedy output equal to the offline engine, `sglext`
consistent with `usage`, bad input → 4xx with an OpenAI error body, saturation → 503 + Retry-After.

One Serve instance for the module (Ray starts slowly on small machines): a tiny random Llama with
SmolLM2's vocabulary and tokenizer, an untrained drafter and the native selector.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import socket
import time

import pytest
import requests

openai = pytest.importorskip("openai")
ray = pytest.importorskip("ray")

from deploy.serve.config import parse_config  # noqa: E402

KEY_ENV, KEY = "DRELAY_TEST_SERVE_KEY", "test-secret"
# Set on import (collection, before any test starts Ray): replicas are Ray workers, and they inherit the
# environment of the moment the session's Ray instance starts.
os.environ[KEY_ENV] = KEY
MODEL = "tiny-drelay"
CONFIG = {
    "model_id": MODEL,
    "engine": {
        "target": "tiny-llama:vocab=49152",
        "tokenizer": "smollm2-135m",
        "method": "native",
        "random_drafter": True,
        "max_batch": 2,
    },
    "limits": {"max_tokens": 200, "default_max_tokens": 16, "max_prompt_tokens": 900, "max_waiting": 1},
    "max_ongoing_requests": 16,
    "num_cpus": 0.5,
    "graceful_shutdown_timeout_s": 5,
    "auth": {"api_key_env": KEY_ENV},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(ray_session):
    from ray import serve

    from deploy.serve.commands import start

    cfg = parse_config({**CONFIG, "port": _free_port()})
    url = start(cfg, name="drelay-test")
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            if requests.get(f"{url}/ready", timeout=5).status_code == 200:
                break
        except requests.RequestException:
            pass
        time.sleep(1)
    else:
        pytest.fail("the Serve app never became ready")
    yield url
    serve.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline():
    """The same engine in this process: its greedy text is what the server must return."""
    from deploy.serve.backends.engine import load_tokenizer
    from drelay_model.decoding import GenerationConfig, SpeculativeEngine
    from drelay_model.target import load_target
    from pipelines.common.methods import load_method, resolve_method

    target = load_target(CONFIG["engine"]["target"])
    drafter, selector = load_method(resolve_method("native", target_spec="tiny-llama", random_drafter=True), target)
    engine, tok = SpeculativeEngine(target, drafter, selector), load_tokenizer("smollm2-135m")

    def generate(prompt_ids: list[int], max_tokens: int) -> tuple[str, int]:
        ids = engine.generate([prompt_ids], GenerationConfig(max_new_tokens=max_tokens)).tokens[0]
        return tok.decode(ids, skip_special_tokens=True), len(ids)

    def chat_ids(text: str) -> list[int]:
        enc = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        return list(enc["input_ids"] if hasattr(enc, "keys") else enc)

    return generate, chat_ids, tok


def _check_sglext(usage, sglext) -> None:
    assert sglext["method"] == "native"
    assert sglext["spec_verify_ct"] == sum(sglext["spec_correct_drafts_histogram"]) >= 1
    assert sglext["spec_accept_length"] == pytest.approx(usage.completion_tokens / sglext["spec_verify_ct"])


def test_models_health_ready(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = requests.get(f"{server}/health", timeout=10).json()
    # the replica's thread policy is auto (the cores of its affinity others leave free), not Ray's
    # OMP_NUM_THREADS = num_cpus (0.5 → 1)
    assert health["status"] == "ok" and health["threads"] == "auto"
    assert 1 <= health["torch_threads"] <= len(os.sched_getaffinity(0))
    assert requests.get(f"{server}/ready", timeout=10).json()["ready"] is True


def test_the_replica_answers_on_its_own_port_as_through_the_proxy(server, client):
    """`ingress: direct`: the replica's own HTTP server (no proxy hop) gives the same greedy stream
    and keeps the same auth."""
    from deploy.serve.ingress import direct_urls

    urls = direct_urls("drelay-test", "127.0.0.1", timeout=60)
    assert len(urls) == 1 and urls[0] != server and urls[0].startswith("http://127.0.0.1:33")
    direct = openai.OpenAI(base_url=f"{urls[0]}/v1", api_key=KEY, max_retries=0, timeout=120)
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=12, temperature=0)

    def streamed(c) -> str:
        return "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(stream=True, **kwargs) if ch.choices)

    assert streamed(direct) == streamed(client) != ""
    assert requests.get(f"{urls[0]}/v1/models", timeout=10).status_code == 401


def test_the_target_groups_adapter_holds_on_this_ray_version(server):
    """`serve_target_groups` reads Ray Serve's private controller client (the one such place): checked
    against this running app on the Ray versions it names; another version fails here until checked."""
    from ray.serve.schema import TargetGroup

    from deploy.serve.ingress import RAY_VERSIONS_CHECKED, serve_target_groups

    assert ray.__version__ in RAY_VERSIONS_CHECKED, (
        f"Ray {ray.__version__}: check deploy/serve/ingress.py's serve_target_groups on it, then add it to RAY_VERSIONS_CHECKED"
    )
    groups = [g for g in serve_target_groups() if g.app_name == "drelay-test" and g.protocol == "HTTP"]
    assert groups and all(isinstance(g, TargetGroup) for g in groups)
    ingress = [g for g in groups if g.ingress_deployment_name == "drelay"]
    assert len(ingress) == 1 and len(ingress[0].targets) == 1 and ingress[0].targets[0].port >= 33000


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_chat_greedy_equals_offline_engine(client, offline, stream):
    generate, chat_ids, _ = offline
    prompt = "What is two plus two?"
    expected, n = generate(chat_ids(prompt), 24)
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=24,
        temperature=0,
        extra_body={"return_spec_tokens_details": True},
    )
    if not stream:
        out = client.chat.completions.create(**kwargs)
        text, usage, sglext, finish = (
            out.choices[0].message.content,
            out.usage,
            out.model_extra["sglext"],
            out.choices[0].finish_reason,
        )
    else:
        parts, usage, sglext, finish = [], None, None, None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                parts.append(c.delta.content or "")
                finish = c.finish_reason or finish
            if chunk.usage is not None:
                usage, sglext = chunk.usage, chunk.model_extra["sglext"]
        text = "".join(parts)
    assert text == expected
    assert finish == "length" and usage.completion_tokens == n == 24
    assert usage.prompt_tokens == len(chat_ids(prompt))
    _check_sglext(usage, sglext)


def test_completions_streamed_and_not_agree(client, offline):
    generate, _, tok = offline
    prompt = "The capital of France is"
    expected, _ = generate(tok(prompt)["input_ids"], 20)
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
    assert whole.choices[0].text == expected and whole.usage.completion_tokens == 20
    assert "sglext" not in (whole.model_extra or {})  # only on request
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True, extra_body={"return_spec_tokens_details": True}
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    last = chunks[-1]
    _check_sglext(last.usage, last.model_extra["sglext"])


def test_stop_string_and_sampling(client, offline):
    generate, chat_ids, _ = offline
    full, _ = generate(chat_ids("Say something."), 30)
    stop = full[10:14]
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say something."}], max_tokens=30, temperature=0, stop=[stop]
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content == full[: full.find(stop)]
    seeded = [
        client.completions.create(model=MODEL, prompt="Once", max_tokens=12, temperature=0.9, top_p=0.9, seed=3).choices[0].text
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]


BAD = [
    ("malformed JSON", b"{not json", None, 400),
    ("missing messages", {"model": MODEL}, "messages", 400),
    ("messages of the wrong type", {"model": MODEL, "messages": "hello"}, "messages", 400),
    (
        "max_tokens of the wrong type",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": "5"},
        "max_tokens",
        400,
    ),
    (
        "negative max_tokens",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -3},
        "max_tokens",
        400,
    ),
    ("huge max_tokens", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**9}, "max_tokens", 400),
    (
        "temperature out of range",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": 7.5},
        "temperature",
        400,
    ),
    ("prompt over the context window", {"model": MODEL, "prompt": list(range(100, 950)), "max_tokens": 200}, "prompt", 400),
    ("unknown model", {"model": "gpt-17", "messages": [{"role": "user", "content": "x"}]}, "model", 404),
    ("unknown field", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logit_bias": {}}, "logit_bias", 400),
]


def test_bad_input_is_a_4xx_with_an_openai_error_then_a_good_request_works(server, client):
    for label, body, param, status in BAD:
        route = "completions" if isinstance(body, dict) and "prompt" in body else "chat/completions"
        kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
        r = requests.post(f"{server}/v1/{route}", headers={"Authorization": f"Bearer {KEY}"}, timeout=60, **kwargs)
        assert r.status_code == status, f"{label}: {r.status_code} {r.text}"
        err = r.json()["error"]
        assert err["message"] and err["type"] == "invalid_request_error" and err["param"] == param, label
    r = requests.post(
        f"{server}/v1/chat/completions",
        headers={"Authorization": "Bearer wrong"},
        timeout=60,
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
    )
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    # The scheme is case-insensitive (RFC 7235 §2.1): a lower-case `bearer` is the same credential.
    r = requests.get(f"{server}/v1/models", headers={"Authorization": f"bearer  {KEY}"}, timeout=60)
    assert r.status_code == 200, r.text
    for wrong in (f"Basic {KEY}", f"Bearer {KEY}x", "Bearer", KEY):
        r = requests.get(f"{server}/v1/models", headers={"Authorization": wrong}, timeout=60)
        assert r.status_code == 401, wrong
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).models.list()
    ok = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
    assert ok.usage.completion_tokens == 4


def test_saturation_answers_503_with_retry_after(server, client):
    """max_batch 2 + max_waiting 1: of 8 simultaneous long requests some are refused, none lost."""

    def one(i: int):
        return requests.post(
            f"{server}/v1/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=300,
            json={"model": MODEL, "prompt": f"request {i}", "max_tokens": 200, "temperature": 0},
        )

    with cf.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(one, range(8)))
    codes = sorted(r.status_code for r in replies)
    assert set(codes) <= {200, 503} and codes.count(200) >= 3 and 503 in codes, codes
    for r in replies:
        if r.status_code == 503:
            assert r.headers["Retry-After"] == "1" and r.json()["error"]["code"] == "overloaded"
        else:
            assert r.json()["usage"]["completion_tokens"] == 200
    assert client.completions.create(model=MODEL, prompt="after", max_tokens=3, temperature=0).usage.completion_tokens == 3


def _scrape(url: str) -> dict[str, tuple[str, dict[tuple, float]]]:
    """Prometheus text → {family: (type, {(sample name, sorted labels): value})}."""
    from prometheus_client.parser import text_string_to_metric_families

    reply = requests.get(url, timeout=30)
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain"), reply.text[:200]
    return {
        f.name: (f.type, {(s.name, tuple(sorted(s.labels.items()))): s.value for s in f.samples})
        for f in text_string_to_metric_families(reply.text)
    }


def _total(scrape, family: str, sample: str) -> float:
    """The sum of `sample` over every label set of `family` (0 before the first observation)."""
    return sum(v for (name, _), v in scrape.get(family, ("", {}))[1].items() if name == sample)


def test_prometheus_metrics_on_the_app_and_on_rays_export_port(server, client):
    """GET /metrics on the endpoint: every series with its Prometheus type; two requests move the
    counts by what their answers report (tokens, rounds). The same series reach Ray's metrics port."""
    before = _scrape(f"{server}/metrics")
    spec = {"return_spec_tokens_details": True}
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count."}], max_tokens=9,
                                          temperature=0, extra_body=spec)  # fmt: skip
    text = client.completions.create(model=MODEL, prompt="metrics", max_tokens=5, temperature=0, extra_body=spec)
    after = _scrape(f"{server}/metrics")
    types = {
        "drelay_time_to_first_token_seconds": "histogram", "drelay_e2e_request_latency_seconds": "histogram",
        "drelay_time_per_output_token_seconds": "histogram", "drelay_request_queue_time_seconds": "histogram",
        "drelay_request_prefill_time_seconds": "histogram", "drelay_spec_tokens_per_round": "histogram",
        "drelay_spec_accepted_drafts_per_round": "histogram", "drelay_batch_size": "histogram",
        "drelay_generation_tokens": "counter", "drelay_prompt_tokens": "counter", "drelay_requests": "counter",
        "drelay_spec_rounds": "counter", "drelay_spec_accepted_drafts": "counter",
        "drelay_num_requests_running": "gauge", "drelay_num_requests_waiting": "gauge",
    }  # fmt: skip
    assert {name: after[name][0] for name in types if name in after} == types
    for name in ("drelay_time_to_first_token_seconds", "drelay_e2e_request_latency_seconds", "drelay_spec_tokens_per_round"):
        assert _total(after, name, f"{name}_count") - _total(before, name, f"{name}_count") == 2, name
    usage = chat.usage.completion_tokens + text.usage.completion_tokens
    moved = _total(after, "drelay_generation_tokens", "drelay_generation_tokens_total")
    assert moved - _total(before, "drelay_generation_tokens", "drelay_generation_tokens_total") == usage
    rounds = chat.model_extra["sglext"]["spec_verify_ct"] + text.model_extra["sglext"]["spec_verify_ct"]
    per_round = "drelay_spec_accepted_drafts_per_round"
    assert _total(after, per_round, f"{per_round}_count") - _total(before, per_round, f"{per_round}_count") == rounds
    steps = "drelay_batch_size"
    assert _total(after, steps, f"{steps}_count") > _total(before, steps, f"{steps}_count")
    ok = ("drelay_requests_total", (("method", "native"), ("route", "completions"), ("status", "200")))
    assert after["drelay_requests"][1][ok] >= 1
    assert after["drelay_num_requests_running"][1][("drelay_num_requests_running", (("method", "native"),))] == 0
    # Ray's export port: the same series through ray.serve.metrics, prefixed `ray_`, with Serve's tags
    port = ray.nodes()[0]["MetricsExportPort"]
    wanted = ("ray_drelay_time_to_first_token_seconds_bucket", "ray_drelay_generation_tokens_total",
              "ray_drelay_num_requests_running", "ray_drelay_spec_accepted_drafts_per_round_bucket")  # fmt: skip
    deadline, scraped = time.time() + 60, ""
    while time.time() < deadline:  # Ray exports every few seconds
        scraped = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        tags = ('application="drelay-test"', 'method="native"', 'route="completions"')  # a series' tags can come a round later
        if all(f"{name}{{" in scraped for name in wanted) and all(t in scraped for t in tags):
            break
        time.sleep(2)
    assert not [name for name in wanted if f"{name}{{" not in scraped], scraped[:2000]
    assert 'method="native"' in scraped and 'route="completions"' in scraped


def test_logprobs_on_both_routes_streamed_and_not(server, client):
    """The official client parses `logprobs` (chat: content[] with top_logprobs; completions: tokens,
    token_logprobs, top_logprobs, text_offset), streamed chunks carry their tokens' entries, and a bad
    value is a 400 naming its field (values against the target's forward: test_serve_logprobs.py)."""
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Count to three."}], max_tokens=8, temperature=0)
    whole = client.chat.completions.create(logprobs=True, top_logprobs=2, **chat)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 8
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token and c.logprob <= 0 for c in content)
    chunks = list(client.chat.completions.create(logprobs=True, top_logprobs=2, stream=True, **chat))
    streamed = [e for ch in chunks for c in ch.choices if c.logprobs for e in c.logprobs.content]
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)

    comp = dict(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    lp = client.completions.create(logprobs=1, **comp).choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert all(top[t] == v for t, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
    parts = [c.choices[0].logprobs for c in client.completions.create(logprobs=1, stream=True, **comp) if c.choices]
    assert [t for p in parts if p for t in p.tokens] == lp.tokens

    bad = [
        ("chat/completions", {"messages": chat["messages"], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat/completions", {"messages": chat["messages"], "top_logprobs": 1}, "top_logprobs"),
        ("completions", {"prompt": "x", "logprobs": 6}, "logprobs"),
    ]
    for route, body, param in bad:
        r = requests.post(
            f"{server}/v1/{route}", headers={"Authorization": f"Bearer {KEY}"}, timeout=60, json={"model": MODEL, **body}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(logprobs=True, top_logprobs=99, **chat)
