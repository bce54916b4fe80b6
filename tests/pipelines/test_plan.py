"""`drelay plan`: the shipped Qwen3 configs fit one 80 GB GPU with at least 10% margin under the
attention path CUDA takes (named in the output); a config that does not fit is exit 2."""

from __future__ import annotations

import pytest

from pipelines.train.config import load_config
from cli import main as drelay
from drelay_model.attention import MATH, SDPA_EXPANDED, SDPA_GQA, attention_path
from drelay_model.training import memory_plan as mp
from pipelines.train.plan import plan_from_config, predicted_peak_bytes


@pytest.mark.parametrize("name, selector_m", [("qwen3-4b", 34.65), ("qwen3-8b", 42.91)])
def test_shipped_qwen3_configs_fit_80_gb_with_10_percent_margin(name, selector_m):
    report = plan_from_config(load_config(f"platform/experiments/{name}/train.yaml"), 80)
    assert report.device == "cuda" and report.plan.attention == attention_path("cuda") == SDPA_EXPANDED
    assert report.fits and report.plan.total <= 0.9 * 80e9  # ≤ 72 GB (decimal), the stricter reading
    assert predicted_peak_bytes(load_config(f"platform/experiments/{name}/train.yaml")) == report.plan.total
    assert report.selector_params / 1e6 == pytest.approx(selector_m, abs=0.01)


def test_the_plan_prices_the_attention_path_of_its_device():
    """CPU and CUDA take different paths and are priced differently; the math fallback (what SDPA
    with a bool mask and grouped heads runs on CUDA) would not fit at all."""
    cfg = load_config("platform/experiments/qwen3-4b/train.yaml")
    cpu, cuda = (plan_from_config(cfg, device=d).plan for d in ("cpu", "cuda"))
    assert (cpu.attention, cuda.attention) == (SDPA_GQA, SDPA_EXPANDED) and cpu.total != cuda.total
    assert plan_from_config(load_config("platform/experiments/qwen3-4b/train.yaml", ["ray.use_gpu=false"])).device == "cpu"
    math_plan = mp.estimate(*plan_from_config(cfg).shapes, attention=MATH)
    assert math_plan.total > 80 * 2**30 > 0.9 * 80e9 > cuda.total


def test_a_plan_that_does_not_fit_is_exit_2_with_one_line(capsys):
    rc = drelay(["plan", "--config", "platform/experiments/qwen3-8b/train.yaml", "train.micro_batches=1"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("drelay: error: the plan needs") and "\n" not in err
    assert drelay(["plan", "--config", "platform/experiments/qwen3-4b/train.yaml", "--gpu-memory", "-1"]) == 2
    assert "--gpu-memory must be" in capsys.readouterr().err


def test_plan_prints_components_for_a_config_that_fits(capsys):
    assert drelay(["plan", "--config", "platform/experiments/qwen3-4b/train.yaml"]) == 0
    out = capsys.readouterr().out
    assert "selector 34.7M params" in out and "fits" in out.lower()
    assert "on cuda" in out and "attention path: sdpa-expanded" in out
    assert drelay(["plan", "--config", "platform/experiments/qwen3-4b/train.yaml", "--device", "cpu"]) == 0
    assert "attention path: sdpa-gqa" in capsys.readouterr().out


def test_micro_batches_shrink_activations():
    cfg = "platform/experiments/qwen3-4b/train.yaml"
    one, eight = (plan_from_config(load_config(cfg, [f"train.micro_batches={m}"])) for m in (1, 8))
    assert eight.plan.components["activations"] < one.plan.components["activations"] / 3


def test_train_refuses_a_gpu_run_whose_plan_exceeds_the_gpu(monkeypatch):
    """`drelay train` checks the plan against the driver's GPU before Ray starts (CUDA faked here:
    a unit test of the check around the planner)."""
    import types

    import torch

    from drelay_model.errors import DRelayError
    from pipelines.train.driver import check_memory

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=40 * 2**30))
    cfg = load_config("platform/experiments/qwen3-8b/train.yaml", ["ray.use_gpu=true"])
    with pytest.raises(DRelayError, match="the plan needs .* GiB per GPU, more than 40 GiB"):
        check_memory(cfg)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=80 * 2**30))
    check_memory(cfg)  # the shipped config fits an 80 GB GPU


@pytest.mark.parametrize("name", ["qwen3-4b", "qwen3-8b"])
def test_selector_stage_configs_plan_their_block_cache(name, capsys):
    """The Qwen3 selector-stage configs fit, and the plan states the cache's size: per block
    H·D bf16 + H·K·8 + H·5 + 20 bytes, per sequence max_seq_len·L·D bf16 features."""
    cfg = load_config(f"platform/experiments/{name}/selector-stage.yaml")
    report = plan_from_config(cfg)
    D = {"qwen3-4b": 2560, "qwen3-8b": 4096}[name]
    per_seq = 64 * (15 * D * 2 + 15 * 16 * 8 + 15 * 5 + 20) + 3072 * 5 * D * 2
    assert report.fits and report.cache_bytes == 1024 * per_seq
    assert drelay(["plan", "--config", f"platform/experiments/{name}/selector-stage.yaml"]) == 0
    assert "selector stage: block cache ≤" in capsys.readouterr().out
