"""The serving metrics without a server: what one finished request and one sample record, read back
from the Prometheus text the app's /metrics serves (types, names, per-round counts, τ). The same
series on a running app and on Ray's export port: tests/deploy/test_serve_app.py."""

from __future__ import annotations

import pytest

from deploy.serve.backends.base import SpecStats
from deploy.serve.metrics import SERIES, ServeMetrics

parser = pytest.importorskip("prometheus_client.parser")


def _families(metrics: ServeMetrics) -> dict:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    return {f.name: f for f in parser.text_string_to_metric_families(body.decode())}


def _value(family, sample: str, **labels) -> float:
    return sum(s.value for s in family.samples if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


def test_every_series_has_a_prometheus_name_and_an_ascii_help():
    names = [s.name for s in SERIES]
    assert len(set(names)) == len(names)
    for s in SERIES:
        assert s.name.startswith("drelay_") and not s.name.endswith("_total") and s.help.isascii(), s.name
        assert s.kind in ("counter", "gauge", "histogram") and (s.kind == "histogram") == bool(s.buckets), s.name
        assert s.kind != "histogram" or s.unit != "s" or s.name.endswith("_seconds"), s.name


def test_a_finished_request_and_a_sample_read_back():
    metrics = ServeMetrics("drelay")
    # 4 rounds accepting 0, 1, 1, 2 drafts: 4 + 4 = 8 tokens committed, + the prefill token = 9
    spec = SpecStats(verify_ct=4, accept_histogram=[1, 2, 1, 0], completion_tokens=9, drafted_ct=3, verified_drafts=9,
                     ttft_parts=(0.01, 0.1, 0.09))  # fmt: skip
    metrics.finished("chat", latency=1.0, ttft=0.2, prompt_tokens=5, tokens=9, spec=spec)
    metrics.failed("chat", 400)
    metrics.sample({"running": 3, "waiting": 1}, [1, 2, 2])
    fam = _families(metrics)
    assert {
        name: fam[name].type for name in ("drelay_generation_tokens", "drelay_batch_size", "drelay_num_requests_running")
    } == {
        "drelay_generation_tokens": "counter",
        "drelay_batch_size": "histogram",
        "drelay_num_requests_running": "gauge",
    }
    tags = {"method": "drelay", "route": "chat"}
    assert _value(fam["drelay_generation_tokens"], "drelay_generation_tokens_total", **tags) == 9
    assert _value(fam["drelay_prompt_tokens"], "drelay_prompt_tokens_total", **tags) == 5
    assert _value(fam["drelay_requests"], "drelay_requests_total", status="200") == 1
    assert _value(fam["drelay_requests"], "drelay_requests_total", status="400") == 1
    assert _value(fam["drelay_spec_rounds"], "drelay_spec_rounds_total") == 4
    assert _value(fam["drelay_spec_accepted_drafts"], "drelay_spec_accepted_drafts_total") == 4
    per_round = fam["drelay_spec_accepted_drafts_per_round"]
    assert _value(per_round, "drelay_spec_accepted_drafts_per_round_count", method="drelay") == 4
    assert _value(per_round, "drelay_spec_accepted_drafts_per_round_bucket", le="0.5") == 1  # the round that accepted none
    assert _value(per_round, "drelay_spec_accepted_drafts_per_round_bucket", le="1.5") == 3
    assert _value(fam["drelay_spec_tokens_per_round"], "drelay_spec_tokens_per_round_sum") == pytest.approx(2.0)  # τ = 8 / 4
    tpot = _value(fam["drelay_time_per_output_token_seconds"], "drelay_time_per_output_token_seconds_sum")
    assert tpot == pytest.approx(0.8 / 8)
    assert _value(fam["drelay_request_queue_time_seconds"], "drelay_request_queue_time_seconds_sum") == pytest.approx(0.01)
    assert _value(fam["drelay_num_requests_running"], "drelay_num_requests_running", method="drelay") == 3
    assert _value(fam["drelay_num_requests_waiting"], "drelay_num_requests_waiting") == 1
    assert _value(fam["drelay_batch_size"], "drelay_batch_size_count") == 3
    assert _value(fam["drelay_batch_size"], "drelay_batch_size_sum") == 5
