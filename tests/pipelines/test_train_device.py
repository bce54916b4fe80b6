"""Training on devices: config fields and the one-line error for CUDA on a machine without it."""

from __future__ import annotations

import pytest
import torch

from drelay_model.errors import DRelayError
from pipelines.train.config import load_config
from pipelines.train.driver import check_device, scaling_config, torch_config


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_device_without_cuda_is_a_one_line_error():
    with pytest.raises(DRelayError, match="CUDA is not available") as err:
        check_device(load_config(None, ["target.device=cuda", "ray.use_gpu=true"]))
    assert "\n" not in str(err.value)
    with pytest.raises(DRelayError, match="needs ray.use_gpu"):
        check_device(load_config(None, ["target.device=cuda"]))


def test_gpu_scaling_fields_reach_ray():
    cfg = load_config(None, ["ray.use_gpu=true", "ray.gpus_per_worker=1", "ray.accelerator_type=H800", "ray.num_workers=8"])
    sc = scaling_config(cfg)
    assert sc.num_workers == 8 and sc.use_gpu and sc.accelerator_type == "H800"
    assert sc.resources_per_worker["GPU"] == 1
    check_device(cfg)  # device auto: fine anywhere
    with pytest.raises(DRelayError, match="target.device"):
        load_config(None, ["target.device=tpu"])
    with pytest.raises(DRelayError, match="train.micro_batches"):
        load_config(None, ["train.micro_batches=0"])


def test_the_collective_timeout_reaches_ray_and_outlasts_a_validation():
    """Rank 0 validates while the others wait in an all-reduce: the process group waits `ray.timeout_s`."""
    from ray.train.torch import TorchConfig

    tc = torch_config(load_config(None, []))
    assert isinstance(tc, TorchConfig) and tc.timeout_s == 7200 > TorchConfig().timeout_s
    assert torch_config(load_config(None, ["ray.timeout_s=600"])).timeout_s == 600
    with pytest.raises(DRelayError, match="ray.timeout_s"):
        load_config(None, ["ray.timeout_s=5"])
