"""What the GPU check's steps share: the paper's Qwen3-4B setting, random targets of its shape,
timing, and the rule that these scripts import only drelay_model, torch, triton, transformers (and
its own dependencies: numpy, pyyaml), safetensors and pytest — what the GPU machine has.

Scales: `full` is what `benchmarks/gpu_check.sh` runs on the GPU; `tiny` runs every step's code on
CPU in seconds (tests/model/test_gpu_check.py), so a step's logic is checked before a GPU is lent.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
PAPER_CONFIG = REPO / "platform" / "experiments" / "qwen3-4b" / "train.yaml"  # the paper's setting
CONFIGS = REPO / "platform" / "experiments"  # <model>/train.yaml
SCALES = ("full", "tiny")

# Qwen3-4B's config.json (the shapes `drelay plan` knows as Qwen/Qwen3-4B).
QWEN3_4B = dict(
    vocab_size=151_936,
    hidden_size=2560,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=9728,
    tie_word_embeddings=True,
)
# Qwen3-8B's config.json (Qwen/Qwen3-8B in `drelay plan`): wider, untied head.
QWEN3_8B = dict(
    vocab_size=151_936,
    hidden_size=4096,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=12288,
    tie_word_embeddings=False,
)
# The same architecture at test size, for the CPU runs of each step.
QWEN3_TINY = dict(
    vocab_size=2048,
    hidden_size=64,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    tie_word_embeddings=True,
)


def paper_setting(model: str = "qwen3-4b") -> dict:
    """The drafter, selector and per-worker step of platform/experiments/<model>/train.yaml (read
    with pyyaml, a transformers dependency: the run config's pydantic schema is not needed here)."""
    import yaml

    doc = yaml.safe_load((CONFIGS / model / "train.yaml").read_text())
    return {
        "drafter": doc["drafter"],
        "selector": doc["selector"]["config"],
        "train": doc["train"],
        "max_seq_len": doc["data"]["max_seq_len"],
    }


def random_qwen3_target(shape: dict, *, layers: int | None = None, device: str, dtype: torch.dtype, seed: int = 0):
    """A random-weight Qwen3 target (drelay_model's TargetModel) of `shape` (QWEN3_4B or QWEN3_TINY),
    optionally with fewer layers, built directly on `device` in `dtype` (no host copy of the weights)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from drelay_model.target import TargetModel

    cfg = Qwen3Config(
        **{**shape, "num_hidden_layers": layers or shape["num_hidden_layers"]},
        max_position_embeddings=8192,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return TargetModel(model, name=f"random-qwen3:hidden={cfg.hidden_size},layers={cfg.num_hidden_layers}")


def sync(device: str | torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, device: str | torch.device, *, warmup: int = 5, reps: int = 30) -> float:
    """Median wall milliseconds of fn() (CUDA events on a GPU, perf_counter elsewhere)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        if torch.device(device).type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 4)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    finite = torch.isfinite(a) & torch.isfinite(b)
    if not bool(torch.equal(torch.isfinite(a), torch.isfinite(b))):
        return float("inf")
    return float((a.float() - b.float())[finite].abs().max()) if bool(finite.any()) else 0.0
