"""`drelay plan`: the shipped Qwen3 configs fit one 80 GB GPU; a config that does not is exit 2."""

from __future__ import annotations

import pytest

from pipelines.train.config import load_config
from pipelines.cli import main as drelay
from pipelines.train.plan import plan_from_config


@pytest.mark.parametrize("name, selector_m", [("qwen3-4b", 34.5), ("qwen3-8b", 42.7)])
def test_shipped_qwen3_configs_fit_80_gb(name, selector_m):
    report = plan_from_config(load_config(f"platform/experiments/{name}/train.yaml"), 80)
    assert report.fits and report.plan.total < 80 * 2**30
    assert report.selector_params / 1e6 == pytest.approx(selector_m, abs=0.1)


def test_a_plan_that_does_not_fit_is_exit_2_with_one_line(capsys):
    rc = drelay(["plan", "--config", "platform/experiments/qwen3-8b/train.yaml", "train.micro_batches=1"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("drelay: error: the plan needs") and "\n" not in err
    assert drelay(["plan", "--config", "platform/experiments/qwen3-4b/train.yaml", "--gpu-memory", "-1"]) == 2
    assert "--gpu-memory must be" in capsys.readouterr().err


def test_plan_prints_components_for_a_config_that_fits(capsys):
    assert drelay(["plan", "--config", "platform/experiments/qwen3-4b/train.yaml"]) == 0
    out = capsys.readouterr().out
    assert "selector 34.5M params" in out and "fits" in out.lower()


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
