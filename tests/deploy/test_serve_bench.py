"""`drelay serve-bench`'s logic and its errors, without Ray: the ABBA leg schedule, legs merged into levels,
the B ÷ A ratios and the report; every bad input is one line naming the flag or field, exit 2, and no
MLflow store or plot is written. URL probing runs against a real local HTTP server."""

from __future__ import annotations

import json
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from deploy.serve.bench import LevelResult, Sample
from deploy.serve.bench_intervals import pooled_p99_ratio, ratio_intervals
from deploy.serve.bench_pairing import Endpoint, leg_schedule, level_lines, markdown_table, order_name, ratios
from deploy.serve.bench_run import probe_urls
from drelay_model.errors import DRelayError
from cli.main import main

AR_CONFIG = "platform/serve/smollm2-135m-ar.yaml"


# ---- pairing -------------------------------------------------------------------------------------
def test_abba_schedule_alternates_within_each_level():
    legs = leg_schedule([1, 4], 2, 2)
    assert [(leg.concurrency, "AB"[leg.endpoint], leg.round) for leg in legs] == [
        (1, "A", 0), (1, "B", 0), (1, "B", 1), (1, "A", 1),
        (4, "A", 0), (4, "B", 0), (4, "B", 1), (4, "A", 1),
    ]  # fmt: skip
    assert order_name(2, 4) == "ABBAABBA" and order_name(2, 1) == "AB" and order_name(1, 3) == "AAA"
    # balance: with an even number of rounds, A's and B's legs have the same mean position in the level
    for rounds in (2, 4, 6):
        pos = {0: [], 1: []}
        for i, leg in enumerate(leg_schedule([8], 2, rounds)):
            pos[leg.endpoint].append(i)
        assert sum(pos[0]) == sum(pos[1]) and len(pos[0]) == len(pos[1]) == rounds


def test_legs_merge_into_one_level():
    a = LevelResult(2, 4.0, [Sample(200, latency=1.0, ttft=0.1, tokens=8, tau=1.5), Sample(503, latency=0.01)])
    b = LevelResult(2, 6.0, [Sample(200, latency=3.0, ttft=0.3, tokens=12, tau=2.5)])
    row = LevelResult.merged([a, b]).summary()
    assert row["wall_s"] == 10.0 and row["requests"] == 3 and row["failures"] == 1 and row["status_503"] == 1
    assert row["tokens_per_s"] == pytest.approx(20 / 10.0) and row["req_per_s"] == pytest.approx(0.2)
    assert row["latency_p50_s"] == 1.0 and row["latency_p99_s"] == 3.0 and row["tau_mean"] == pytest.approx(2.0)
    assert LevelResult(1, 1.0, [Sample(200, latency=1.0, tokens=4)]).summary()["tau_mean"] is None  # no sglext
    with pytest.raises(AssertionError):
        LevelResult.merged([a, LevelResult(4, 1.0)])


def _row(c, tps, p99, ttft99, tau=1.0):
    return {"concurrency": c, "requests": 4, "failures": 0, "tokens_per_s": tps, "latency_p50_s": p99 / 2,
            "latency_p99_s": p99, "ttft_p50_s": ttft99 / 2, "ttft_p99_s": ttft99, "tau_mean": tau}  # fmt: skip


def test_ratios_are_b_over_a_and_the_report_shows_them():
    a, b = _row(4, 10.0, 2.0, 0.5), _row(4, 15.0, 1.5, 0.0, tau=1.8)
    r = ratios(a, b)
    assert r == {"ratio_tokens_per_s": 1.5, "ratio_latency_p99_s": 0.75, "ratio_ttft_p99_s": 0.0}
    assert ratios(_row(1, 0.0, 0.0, 0.0), b)["ratio_tokens_per_s"] is None  # A measured nothing
    endpoints = [
        Endpoint("A", "m-ar", "u", "m-ar", "ar", "a.yaml"),
        Endpoint("B", "m-drelay", "u", "m-drelay", "drelay", "b.yaml"),
    ]
    lines = level_lines([a, b], endpoints, r)
    assert len(lines) == 3 and lines[0].startswith("c=4") and "m-drelay" in lines[1] and "τ 1.80" in lines[1]
    assert "B÷A tokens/s 1.50×" in lines[2] and "latency p99 0.75×" in lines[2]
    table = markdown_table([([a, b], r)], endpoints).splitlines()
    assert len(table) == 4 and table[0].count("|") == table[1].count("|") == table[2].count("|") == table[3].count("|")
    assert "1.50×" in table[3] and "0.75×" in table[3] and "×" not in table[2]


def _legs(rng, rounds, *, speed, load):
    """`rounds` legs of 8 requests: leg r's seconds scale with the machine's slowdown load[r] (and 5% noise)."""
    legs = []
    for r in range(rounds):
        lat = [float(x) for x in rng.lognormal(0.0, 0.2, size=8) * load[r] / speed]
        samples = [Sample(200, latency=x, ttft=x / 4, tokens=32) for x in lat]
        legs.append(LevelResult(4, 8 * 32 / (40.0 * speed) * load[r] * float(rng.lognormal(0.0, 0.05)), samples))
    return legs


def test_ratio_intervals_over_pairs_of_legs():
    """B is 1.5× as fast under a per-leg slowdown both legs of a pair share: the tokens/s interval holds
    the pooled ratio the report prints and excludes 1; latency and TTFT p99 intervals hold their pooled
    ratios; fewer than 3 pairs give none, and the report says why."""
    rng = np.random.default_rng(0)
    load = rng.lognormal(0.0, 0.3, size=4)
    legs_a, legs_b = _legs(rng, 4, speed=1.0, load=load), _legs(rng, 4, speed=1.5, load=load)
    a, b = (LevelResult.merged(x).summary() for x in (legs_a, legs_b))
    r = {**ratios(a, b), **ratio_intervals(legs_a, legs_b)}
    assert r["leg_pairs"] == 4 and r["ratio_tokens_per_s"] == pytest.approx(1.5, rel=0.1)
    assert 1.0 < r["ratio_tokens_per_s_ci_low"] < r["ratio_tokens_per_s"] < r["ratio_tokens_per_s_ci_high"]
    for key in ("latency_p99_s", "ttft_p99_s"):
        assert r[f"ratio_{key}"] == pytest.approx(pooled_p99_ratio(legs_a, legs_b, key.split("_p99")[0]))
        assert r[f"ratio_{key}_ci_low"] <= r[f"ratio_{key}"] <= r[f"ratio_{key}_ci_high"]
    assert ratio_intervals(legs_a, legs_b) == ratio_intervals(legs_a, legs_b)  # seeded: the same every time
    endpoints = [Endpoint("A", "m-ar", "u", "m-ar", "ar", "a"), Endpoint("B", "m-drelay", "u", "m-drelay", "drelay", "b")]
    line = level_lines([a, b], endpoints, r)[-1]
    assert re.search(r"B÷A tokens/s \d\.\d\d× \[\d\.\d\d, \d\.\d\d\]  latency p99 \d\.\d\d× \[", line), line
    assert line.endswith("(95% intervals over 4 pairs of legs)")
    assert re.search(r"\| \d\.\d\d× \[\d\.\d\d, \d\.\d\d\] \| \d\.\d\d× \[", markdown_table([([a, b], r)], endpoints))
    two = ratio_intervals(legs_a[:2], legs_b[:2])
    assert two["leg_pairs"] == 2 and two["ratio_tokens_per_s_ci_low"] is None
    line = level_lines([a, b], endpoints, {**ratios(a, b), **two})[-1]
    assert re.search(r"B÷A tokens/s \d\.\d\d×  latency", line) and line.endswith(
        "(2 pairs of legs; an interval needs --rounds ≥ 3)"
    )


# ---- bad input -----------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def store(tmp_path, monkeypatch):
    """An MLflow store that must stay unwritten; returns its path."""
    db = tmp_path / "mlruns" / "mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    return db


def _fails(capsys, argv: list[str], *needles: str) -> None:
    assert main(["serve-bench", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("drelay: error: "), err
    for n in needles:
        assert n in err, err


def test_bad_flags_are_one_line_each(capsys, store, tmp_path):
    url = f"http://127.0.0.1:{_free_port()}"
    cases = [
        (["--config", AR_CONFIG, "--config", AR_CONFIG], "--config", "same file"),
        (["--config", AR_CONFIG] * 3, "--config", "at most two"),
        (["--url", url, "--url", url + "/"], "--url", "same endpoint"),
        (["--url", url, "--url", url, "--model", "x"], "--model", "one per --url"),
        (["--config", AR_CONFIG, "--model", "x"], "--model", "goes with --url"),
        (["--url", url, "--concurrency", "0"], "--concurrency"),
        (["--url", url, "--concurrency", "2", "2"], "--concurrency", "twice"),
        (["--url", url, "--rounds", "0"], "--rounds"),
        (["--url", url, "--requests", "0"], "--requests"),
        (["--url", url, "--bootstrap-resamples", "50"], "--bootstrap-resamples", "≥ 100"),
        (["--url", url, "--plot", str(tmp_path / "p.svg")], "--plot", ".png"),
        (["--url", url, "--plot", str(tmp_path / "no" / "p.png")], "--plot", "does not exist"),
        (["--url", url], "--url", "unreachable"),
        (["--url", url, "--url", f"http://127.0.0.1:{_free_port()}"], "--url", "unreachable"),
    ]
    for argv, *needles in cases:
        _fails(capsys, argv, *needles)
    assert not store.exists()


def test_bad_configs_name_the_file_and_field(capsys, store, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model_id: x\nengine:\n  max_batch: 0\n")
    _fails(capsys, ["--config", AR_CONFIG, "--config", str(bad)], str(bad), "engine.max_batch")
    _fails(capsys, ["--config", AR_CONFIG, "--config", str(tmp_path / "missing.yaml")], "missing.yaml", "not found")
    with socket.socket() as busy:  # the Serve proxy's port is taken by another server
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        cfg = tmp_path / "busy.yaml"
        cfg.write_text(f"model_id: x\nport: {busy.getsockname()[1]}\n")
        _fails(capsys, ["--config", str(cfg)], "port:", "already in use")
    assert not store.exists()


# ---- URL probing against a real HTTP server ------------------------------------------------------
@pytest.fixture
def openai_models():
    """A local server whose GET /v1/models lists two models (as vLLM's or ours would)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = {"object": "list", "data": [{"id": "m-ar", "method": "ar"}, {"id": "served/other"}]}
            status = 200 if self.path == "/v1/models" else 404
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(json.dumps(body).encode())

        def log_message(self, *_):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_probe_urls_resolves_models_and_refuses_mismatches(openai_models):
    url = openai_models
    a, b = probe_urls([url + "/", url], ["m-ar", "served/other"], None)
    assert (a.tag, a.url, a.model, a.method) == ("A", url, "m-ar", "ar")
    assert (b.tag, b.model, b.method) == ("B", "served/other", "external")
    with pytest.raises(DRelayError, match="--model: .* serves"):
        probe_urls([url], None, None)  # two models served, none named
    with pytest.raises(DRelayError, match="--model: 'nope' is not served"):
        probe_urls([url], ["nope"], None)
    with pytest.raises(DRelayError, match="--url: .* same endpoint"):
        probe_urls([url, url + "/"], ["m-ar", "m-ar"], None)
    with pytest.raises(DRelayError, match="answered HTTP 404"):
        probe_urls([url + "/elsewhere"], ["m-ar"], None)


# ---- the TTFT breakdown --------------------------------------------------------------------------
@pytest.fixture
def streaming_server():
    """A local server answering a streamed chat completion as our endpoint does: a content chunk, then
    the usage chunk with `sglext` and the engine's TTFT parts."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            ext = {"spec_verify_ct": 3, "queue_time_s": 0.05, "prefill_time_s": 0.02, "first_round_time_s": 0.001}
            events = [
                {"choices": [{"delta": {"content": "Hi"}}]},
                {"choices": [], "usage": {"completion_tokens": 4}, "sglext": ext},
            ]
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for e in events:
                self.wfile.write(f"data: {json.dumps(e)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *_):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_the_ttft_breakdown_is_read_pooled_and_reported(streaming_server):
    from deploy.serve.bench import one_request
    from deploy.serve.bench_pairing import ttft_table

    s = one_request(streaming_server, "m", "hello", 4, None)
    assert s.status == 200 and s.tau == pytest.approx(1.0)
    assert (s.ttft_parts["queue"], s.ttft_parts["prefill"], s.ttft_parts["first_round"]) == (0.05, 0.02, 0.001)
    assert s.ttft_parts["serving"] >= 0
    split = {"queue": 0.5, "prefill": 0.2, "first_round": 0.01, "serving": 0.05}
    level = LevelResult(4, 2.0, [Sample(200, 1.0, 0.76, 8, ttft_parts=split), Sample(200, 1.0, 0.2, 8)])
    row = level.summary()
    assert row["queue_p50_s"] == row["queue_p99_s"] == 0.5 and row["serving_p99_s"] == 0.05  # samples without a split skipped
    assert LevelResult(1, 1.0, [Sample(200, 1.0, 0.1, 4)]).summary()["queue_p50_s"] is None  # a server without it
    endpoints = [Endpoint("A", "m-ar", "u", "m-ar", "ar", "a.yaml")]
    lines = level_lines([row], endpoints, None)
    assert len(lines) == 2 and "queue 0.500/0.500" in lines[1] and "first round 0.010/0.010" in lines[1]
    table = ttft_table([([row], None)], endpoints).splitlines()
    assert len(table) == 3 and "0.500 / 0.500" in table[2] and table[0].count("|") == table[2].count("|")
    assert ttft_table([([_row(1, 1.0, 1.0, 1.0)], None)], endpoints) is None
