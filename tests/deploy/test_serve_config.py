"""Serve configs: every shipped platform/serve/*.yaml validates; typos and bad values are one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.serve.app import deployment_options
from deploy.serve.config import load_serve_config, parse_config
from drelay_model.errors import DRelayError

SERVE_DIR = Path(__file__).resolve().parents[2] / "platform" / "serve"


@pytest.mark.parametrize("path", sorted(SERVE_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    cfg = load_serve_config(path)
    opts = deployment_options(cfg)
    assert opts["max_ongoing_requests"] == cfg.max_ongoing_requests
    if cfg.backend == "engine":
        assert cfg.engine.checkpoint is None or (SERVE_DIR.parents[1] / cfg.engine.checkpoint).is_dir()
    elif cfg.backend == "sglang":
        assert cfg.sglang is not None and cfg.num_gpus >= 1
    else:
        assert cfg.vllm is not None


def test_cpu_default_and_qwen_configs_exist():
    assert load_serve_config(SERVE_DIR / "smollm2-135m.yaml").engine.target == "smollm2-135m"
    assert load_serve_config(SERVE_DIR / "qwen3-4b.yaml").backend == "sglang"


def test_autoscaling_options():
    cfg = parse_config({"model_id": "m", "autoscaling": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2}})
    auto = deployment_options(cfg)["autoscaling_config"]
    assert (auto["min_replicas"], auto["max_replicas"], auto["target_ongoing_requests"]) == (1, 2, 2)
    assert "num_replicas" not in deployment_options(cfg)
    assert deployment_options(parse_config({"model_id": "m"}))["num_replicas"] == 1


def test_direct_ingress_environment_is_ray_serves_throughput_mode_with_the_configs_ports():
    from deploy.serve.ingress import DIRECT_PORTS, ray_serve_environment

    cfg = parse_config({"model_id": "m"})
    assert (cfg.ingress, cfg.direct_port) == ("direct", 32000)
    env = ray_serve_environment(cfg.direct_port)
    assert env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    lo, hi = int(env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"]), int(env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"])
    assert (lo, hi - lo + 1) == (32000, DIRECT_PORTS) and hi <= 65535
    # the names are Ray's own: Ray Serve reads each of them
    import ray.serve._private.constants as serve_constants

    source = open(serve_constants.__file__).read()
    assert all(f'"{key}"' in source for key in env)


@pytest.mark.parametrize(
    "doc, message",
    [
        ({"model_id": "m", "enigne": {}}, "enigne: Extra inputs are not permitted"),
        ({"model_id": "m", "engine": {"max_batch": 0}}, "engine.max_batch"),
        ({"model_id": "m", "engine": {"prefill_budget": 8}}, "engine.prefill_budget"),
        ({"model_id": "m", "engine": {"prefill_budget": "all"}}, "engine.prefill_budget"),
        ({"model_id": "m", "limits": {"max_tokens": 8, "default_max_tokens": 16}}, "default_max_tokens"),
        ({"model_id": "m", "autoscaling": {"min_replicas": 3, "max_replicas": 2}}, "min_replicas"),
        ({"model_id": "m", "backend": "sglang"}, "needs an `sglang:` section"),
        ({"model_id": "m", "backend": "vllm"}, "backend"),
        ({"model_id": "bad model id"}, "model_id"),
        ({"model_id": "m", "ingress": "haproxy"}, "ingress"),
        ({"model_id": "m", "direct_port": 65000}, "direct_port"),
        ({"engine": {}}, "model_id: Field required"),
    ],
)
def test_bad_configs_are_one_line_errors(doc, message):
    with pytest.raises(DRelayError, match=message) as info:
        parse_config(doc)
    assert "\n" not in str(info.value)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(DRelayError, match="not found"):
        load_serve_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model_id: [unclosed\n")
    with pytest.raises(DRelayError, match="not valid YAML"):
        load_serve_config(bad)
