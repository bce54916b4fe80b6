"""The memory planner against measured memory: real joint steps (forward + backward, micro-batches,
chunked head, selector) at CPU scale on each attention path (drelay_model/attention.py, forced on
CPU: the CUDA path's code runs here too); the estimate must be within ±25% of the measured peak of
tensor allocations (torch profiler memory events), and what the path itself keeps for backward
(counted with saved-tensor hooks) must match the planner's attention terms."""

from __future__ import annotations

import pytest
import torch

from drelay_model import attention as at
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


def measured_and_estimated(vocab, hidden, N, M, B, micro, chunk, joint, attention=at.SDPA_GQA) -> tuple[int, int]:
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
    with at.forced_attention_path(attention):
        peak, _ = measure_peak_bytes(
            lambda: training_step_backward(module, module, ids, mask, feats, cfg, torch.Generator().manual_seed(0))
        )
    ts = mp.TargetShape(vocab, hidden, 2, 4, 2, hidden // 4, 2 * hidden, bytes_per_param=4)
    ds = mp.DrafterShape(1, hidden, 4, 2, hidden // 4, 2 * hidden, len(dc.target_layer_ids), 16, 8)
    ss = None
    if joint:
        n_params = mp.count_selector_params("drelay", SEL, drafter_shape=ds, target=ts)
        assert n_params == sum(p.numel() for p in selector.parameters())
        ss = mp.SelectorShape(params=n_params, d=32, heads=4, read_dim=32, compact_dim=16, history_len=16)
    assert ds.params() == sum(p.numel() for p in drafter.parameters())
    stages = mp._drafter_step_activations(ts, ds, ss, mp.StepShape(B, N, M, micro, chunk, bf16=False), attention)
    grads = 4 * sum(p.numel() for p in module.parameters())  # allocated by the first backward, inside the window
    return peak, mp.step_peak(stages) + grads


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: "V{}-D{}-N{}-M{}-B{}-mb{}-chunk{}-{}".format(*c[:7], "joint" if c[7] else "drafter")
)
def test_estimate_is_within_25_percent_of_the_measured_peak(case):
    measured, estimated = measured_and_estimated(*case)
    print(
        f"\n{case}: estimate {estimated / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB, ratio {estimated / measured:.2f}"
    )
    assert 0.75 <= estimated / measured <= 1.25, f"estimate {estimated / 2**20:.1f} MiB vs measured {measured / 2**20:.1f} MiB"


# Shapes where attention is a large share of the step: long context, many anchors, small vocabulary.
# The joint case (selector, micro-batches) is marked slow.
PATH_CASES = [(256, 128, 256, 32, 2, 1, 512, False), pytest.param((4096, 64, 256, 32, 2, 2, 256, True), marks=pytest.mark.slow)]


@pytest.mark.parametrize("attention", [at.SDPA_EXPANDED, at.MATH])
@pytest.mark.parametrize("case", PATH_CASES, ids=["V256-drafter", "V4096-joint"])
def test_estimate_per_attention_path_is_within_25_percent_of_the_measured_peak(case, attention):
    measured, estimated = measured_and_estimated(*case, attention=attention)
    print(
        f"\n{attention} {case}: estimate {estimated / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB, ratio {estimated / measured:.2f}"
    )
    assert 0.75 <= estimated / measured <= 1.25, f"estimate {estimated / 2**20:.1f} MiB vs measured {measured / 2**20:.1f} MiB"


def _saved_bytes(drafter, ids, anchors, feats, attention: str) -> int:
    """Bytes of the distinct storages the drafter's training forward saves for backward."""
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    with at.forced_attention_path(attention), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        drafter(ids.gather(1, anchors), anchors, feats)
    return sum(seen.values())


def test_saved_tensor_bytes_of_each_path_match_the_planner():
    """What each path keeps beyond the CPU default, counted with saved-tensor hooks on a real
    drafter forward, against the planner's attention terms at the same shape (fp32: a = 4)."""
    B, N, M, layers = 2, 192, 8, 3
    target = tiny_target("tiny-qwen3", vocab=256, hidden=64, layers=2, heads=4, kv_heads=2)
    dc = DrafterConfig.for_target(target, num_layers=layers)
    drafter = BlockDrafter(dc, target).train()
    ids = torch.randint(0, 256, (B, N), generator=torch.Generator().manual_seed(0))
    feats = target(ids, target.new_cache(B, N), feature_layers=dc.target_layer_ids).features
    anchors = torch.randint(1, N, (B, M), generator=torch.Generator().manual_seed(1))
    gqa = _saved_bytes(drafter, ids, anchors, feats, at.SDPA_GQA)
    Q, Ck, a = M * dc.block_size, N + M * dc.block_size, 4
    args = (a, B, dc.num_heads, dc.num_kv_heads, dc.head_dim, Q, Ck)
    kept_gqa, mask_gqa = mp._attention_bytes(at.SDPA_GQA, *args)
    for path in (at.SDPA_EXPANDED, at.MATH):
        kept, mask = mp._attention_bytes(path, *args)
        # Kept once per forward: the a-byte bias (expanded) or the bool mask (math's masked_fill);
        # sdpa-gqa keeps only its per-layer converted masks (in kept_gqa).
        once = a if path == at.SDPA_EXPANDED else 1
        predicted = layers * (kept - kept_gqa) + once * B * Q * Ck
        measured = _saved_bytes(drafter, ids, anchors, feats, path) - gqa
        print(f"\n{path}: saved beyond sdpa-gqa {measured / 2**20:.3f} MiB, planner {predicted / 2**20:.3f} MiB")
        assert measured == pytest.approx(predicted, rel=0.1), (path, measured, predicted)
        assert mask - mask_gqa == ((a - 1) * B * Q * Ck if path == at.SDPA_EXPANDED else 0)


def test_chunking_and_micro_batches_cut_the_measured_peak():
    dense, _ = measured_and_estimated(16384, 64, 128, 32, 4, 1, 100_000, True)
    lean, _ = measured_and_estimated(16384, 64, 128, 32, 4, 4, 256, True)
    assert lean < 0.5 * dense, (dense, lean)


def test_target_parameter_count_matches_the_model():
    t = tiny_target("tiny-qwen3", vocab=512, hidden=64)
    shape = mp.TargetShape(512, 64, 2, 4, 2, 16, 128)
    assert shape.params() == sum(p.numel() for p in t.hf.parameters())
