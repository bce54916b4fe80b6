"""A real paired `drelay serve-bench` at tiny size: two engine configs (AR and native with an untrained
drafter, a tiny random Llama with SmolLM2's tokenizer) up at once on the session's Ray under their own
route prefixes, levels 1 and 2 in ABBA order; the printed report, the MLflow parent (ratios per level)
and its four children, the plot, and no application left behind."""

from __future__ import annotations

import re
import socket

import pytest
import yaml

pytest.importorskip("ray")
pytest.importorskip("matplotlib")

from cli.main import main  # noqa: E402


def _config(model_id: str, method: str, port: int) -> dict:
    return {
        "model_id": model_id,
        "engine": {"target": "tiny-llama:vocab=49152", "tokenizer": "smollm2-135m", "method": method,
                   "random_drafter": method != "ar", "max_batch": 2, "threads": 1},
        "limits": {"max_tokens": 64, "default_max_tokens": 8},
        "max_ongoing_requests": 8,
        "num_cpus": 0.5,
        "graceful_shutdown_timeout_s": 2,
        "port": port,
    }  # fmt: skip


@pytest.mark.slow  # two replicas deployed and an MLflow store created: ~1 min quiet, minutes when loaded
def test_paired_run_reports_both_endpoints_and_their_ratios(ray_session, tmp_path, uri, capsys):
    from ray import serve

    from pipelines.common.tracking import get_client

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    paths = []
    for name, method in (("tiny-ar", "ar"), ("tiny-native", "native")):
        paths.append(tmp_path / f"{name}.yaml")
        paths[-1].write_text(yaml.safe_dump(_config(name, method, port)))
    plot = tmp_path / "bench.png"
    argv = ["serve-bench", "--config", str(paths[0]), "--config", str(paths[1]), "--concurrency", "1", "2",
            "--requests", "2", "--max-tokens", "8", "--time-limit", "120", "--run-name", "pair", "--plot", str(plot)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert len(re.findall(r"B÷A tokens/s [0-9.]+×", out)) == 2 and "c=1 " in out and "c=2 " in out
    # two legs per endpoint (ABBA): no interval, and the report says what would give one
    assert out.count("(2 pairs of legs; an interval needs --rounds ≥ 3)") == 2
    assert "| B tiny-native | 2 | 4 (0) |" in out  # the Markdown table

    client = get_client(uri)
    exp = client.get_experiment_by_name("serve-bench")
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    parent = runs.pop("pair")
    assert parent.data.params["order"] == "ABBA" and parent.data.params["A_method"] == "ar"
    assert parent.data.params["B_url"].endswith("/bench-b") and parent.data.tags["drelay.kind"] == "serve-bench"
    # each side's load went to its replica's own port (`ingress: direct`), not through the proxy
    assert all(f":{port}/" not in parent.data.params[f"{t}_url"] for t in "AB")
    assert sorted(runs) == ["A-tiny-ar-c1", "A-tiny-ar-c2", "B-tiny-native-c1", "B-tiny-native-c2"]
    for run in runs.values():
        m = run.data.metrics
        assert run.data.tags["mlflow.parentRunId"] == parent.info.run_id and run.info.status == "FINISHED"
        # ABBA: two legs per endpoint, each of max(--requests, concurrency) = 2 requests of 8 tokens
        assert m["requests"] == 4 and m["failures"] == 0 and m["legs"] == 2 and m["tokens_per_s"] > 0
        assert m["tau_mean"] == (1.0 if run.data.params["method"] == "ar" else pytest.approx(m["tau_mean"]))
        assert m["tau_mean"] >= 1.0 and 0 < m["ttft_p50_s"] <= m["latency_p50_s"] <= m["latency_p99_s"]
    for c in (1, 2):
        history = {h.step: h.value for h in client.get_metric_history(parent.info.run_id, "ratio_tokens_per_s")}
        a, b = runs[f"A-tiny-ar-c{c}"].data.metrics, runs[f"B-tiny-native-c{c}"].data.metrics
        assert history[c] == pytest.approx(b["tokens_per_s"] / a["tokens_per_s"])
        p99 = {h.step: h.value for h in client.get_metric_history(parent.info.run_id, "ratio_latency_p99_s")}
        assert p99[c] == pytest.approx(b["latency_p99_s"] / a["latency_p99_s"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not list(tmp_path.glob("*.partial.png"))
    apps = serve.status().applications if serve.context._global_client is not None else {}
    assert not any(name.startswith("drelay-bench") for name in apps)
