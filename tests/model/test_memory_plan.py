"""The memory planner against measured peaks: real joint steps (forward + backward, micro-batches,
chunked head, selector) at CPU scale; the estimate must be within ±25% of the measured peak of
tensor allocations (torch profiler memory events)."""

from __future__ import annotations

import pytest
import torch

from drelay_model.drafter import BlockDrafter, DrafterConfig
from drelay_model.selectors import default_registry
from drelay_model.target import tiny_target
from drelay_model.training import memory_plan as mp
from drelay_model.training.memory_meter import measure_peak_bytes
from drelay_model.training.step import DraftTrainModule, StepConfig, training_step_backward

SEL = {"d_sel": 32, "read_dim": 32, "compact_dim": 16, "history_len": 16, "heads": 4}
# (vocab, hidden, seq_len, anchors, seqs, micro_batches, chunk_tokens, joint)
CASES = [
    (256, 128, 256, 32, 2, 1, 512, False),
    (16384, 64, 128, 16, 2, 1, 512, False),
    (4096, 64, 128, 16, 2, 1, 512, True),
    (8192, 64, 256, 32, 2, 2, 256, True),
    (16384, 128, 256, 32, 4, 2, 512, True),
]


def measured_and_estimated(vocab, hidden, N, M, B, micro, chunk, joint) -> tuple[int, int]:
    target = tiny_target("tiny-qwen3", vocab=vocab, hidden=hidden, layers=2, heads=4, kv_heads=2)
    torch.manual_seed(0)
    dc = DrafterConfig.for_target(target, num_layers=1, top_k=8)
    drafter = BlockDrafter(dc, target)
    selector = default_registry().create("drelay", drafter=drafter, config=SEL) if joint else None
    module = DraftTrainModule(drafter, selector).train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (B, N), generator=g)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 8:] = True
    feats = target(ids, target.new_cache(B, N), feature_layers=dc.target_layer_ids).features
    cfg = StepConfig(anchors_per_seq=M, native_fraction=0.0, micro_batches=micro, chunk_tokens=chunk)
    peak, _ = measure_peak_bytes(lambda: training_step_backward(module, module, ids, mask, feats, cfg, torch.Generator().manual_seed(0)))
    ts = mp.TargetShape(vocab, hidden, 2, 4, 2, hidden // 4, 2 * hidden, bytes_per_param=4)
    ds = mp.DrafterShape(1, hidden, 4, 2, hidden // 4, 2 * hidden, len(dc.target_layer_ids), 16, 8)
    ss = None
    if joint:
        n_params = mp.count_selector_params("drelay", SEL, drafter_shape=ds, target=ts)
        assert n_params == sum(p.numel() for p in selector.parameters())
        ss = mp.SelectorShape(params=n_params, d=32, heads=4, read_dim=32, compact_dim=16, history_len=16)
    assert ds.params() == sum(p.numel() for p in drafter.parameters())
    stages = mp._drafter_step_activations(ts, ds, ss, mp.StepShape(B, N, M, micro, chunk, bf16=False), True)
    grads = 4 * sum(p.numel() for p in module.parameters())  # allocated by the first backward, inside the window
    return peak, mp.step_peak(stages) + grads


@pytest.mark.parametrize("case", CASES, ids=lambda c: "V{}-D{}-N{}-M{}-B{}-mb{}-chunk{}-{}".format(*c[:7], "joint" if c[7] else "drafter"))
def test_estimate_is_within_25_percent_of_the_measured_peak(case):
    measured, estimated = measured_and_estimated(*case)
    print(f"\n{case}: estimate {estimated / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB, ratio {estimated / measured:.2f}")
    assert 0.75 <= estimated / measured <= 1.25, f"estimate {estimated / 2**20:.1f} MiB vs measured {measured / 2**20:.1f} MiB"


def test_chunking_and_micro_batches_cut_the_measured_peak():
    dense, _ = measured_and_estimated(16384, 64, 128, 32, 4, 1, 100_000, True)
    lean, _ = measured_and_estimated(16384, 64, 128, 32, 4, 4, 256, True)
    assert lean < 0.5 * dense, (dense, lean)


def test_target_parameter_count_matches_the_model():
    t = tiny_target("tiny-qwen3", vocab=512, hidden=64)
    shape = mp.TargetShape(512, 64, 2, 4, 2, 16, 128)
    assert shape.params() == sum(p.numel() for p in t.hf.parameters())
