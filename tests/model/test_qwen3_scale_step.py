"""A joint step at Qwen3-4B head scale on the CPU: vocabulary 151,936, width 2,560 (random weights,
one target layer), 512 anchors per sequence, H = 15, K = 16. The dense step would hold logits
[7,680, 151,936] in fp32 three times (14 GB); the chunked step must stay under PEAK_GIB in all:
frozen and trainable weights, features, and the measured peak of the step's allocations."""

from __future__ import annotations

import time

import pytest
import torch

from drelay_model.drafter import BlockDrafter, DrafterConfig
from drelay_model.selectors import default_registry
from drelay_model.target import load_target
from drelay_model.training.memory_meter import measure_peak_bytes
from drelay_model.training.step import DraftTrainModule, StepConfig, training_step_backward

PEAK_GIB = 8.0
SPEC = "tiny-qwen3:vocab=151936,hidden=2560,layers=1,heads=20,kv_heads=4"


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


@pytest.mark.slow
@pytest.mark.heavy
def test_qwen3_4b_shaped_joint_step_stays_under_the_peak():
    target = load_target(SPEC, dtype="bfloat16")
    torch.manual_seed(0)
    drafter = BlockDrafter(DrafterConfig.for_target(target, num_layers=1, top_k=16, block_size=16), target)
    selector = default_registry().create("drelay", drafter=drafter, config={"history_len": 64})
    module = DraftTrainModule(drafter, selector).train()
    N, M = 600, 512
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, target.vocab_size, (1, N), generator=g)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 8:] = True
    with torch.autocast("cpu", dtype=torch.bfloat16):
        feats = target(ids, target.new_cache(1, N), feature_layers=drafter.config.target_layer_ids).features
    cfg = StepConfig(anchors_per_seq=M, native_fraction=0.0, chunk_tokens=1024)
    t0 = time.perf_counter()
    peak, out = measure_peak_bytes(
        lambda: training_step_backward(
            module, module, ids, mask, feats, cfg, torch.Generator().manual_seed(0), autocast_dtype=torch.bfloat16
        )
    )
    seconds = time.perf_counter() - t0
    static = _bytes([*target.parameters(), *target.buffers(), *module.parameters(), *module.buffers(), feats])
    total = static + peak
    print(
        f"\nqwen3-4b-shaped joint step: static {static / 2**30:.2f} GiB + step peak {peak / 2**30:.2f} GiB "
        f"= {total / 2**30:.2f} GiB; {seconds:.0f} s; loss {float(out.loss):.3f}; anchors {out.metrics['anchors']:.0f}"
    )
    assert out.metrics["anchors"] == M and torch.isfinite(out.loss)
    assert all(p.grad is not None for p in module.parameters() if p.requires_grad)
    assert total < PEAK_GIB * 2**30
