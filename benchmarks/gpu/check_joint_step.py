"""Step `joint_step`: one bf16 joint training step at the Qwen3-4B per-worker shape, its measured peak
memory against the memory plan (`drelay plan`'s model, drelay_model/training/memory_plan.py).

The shape is platform/experiments/qwen3-4b/train.yaml's per worker: a random-weight Qwen3-4B target
(36 layers, bf16), the 5-layer drafter on layers 1/9/17/25/33 and the paper-sized DRelay selector
(fp32 weights, AdamW), 8 sequences × 3,072 tokens, 512 anchors per sequence, 8 micro-batches, head
chunks of 2,048 slots, bf16 autocast — what a training worker runs per step (features from the
target's no-grad forward, `training_step_backward`, gradient clipping, `optimizer.step`). A first step
creates AdamW's state; the second is measured: peak tensor memory (torch.cuda.max_memory_allocated;
the profiler's memory events on CPU) against `memory_plan.estimate(...)` priced on the path the
device takes, with shapes read off the built modules. Pass: peak within ±15% of the plan's total.
"""

from __future__ import annotations

import time

import torch

from benchmarks.gpu.common import QWEN3_4B, QWEN3_TINY, paper_setting, random_qwen3_target, sync
from drelay_model.attention import attention_path
from drelay_model.drafter import BlockDrafter, DrafterConfig
from drelay_model.selectors import default_registry
from drelay_model.training import memory_plan as mp
from drelay_model.training.step import DraftTrainModule, StepConfig, training_step_backward

DESCRIPTION = "one bf16 joint step at the Qwen3-4B per-worker shape, measured peak memory vs the memory plan (±15%)"
NEEDS = ("cuda",)
TOLERANCE = 0.15
GiB = 2**30


def _setting(scale: str) -> dict:
    if scale == "full":
        p = paper_setting()
        t = p["train"]
        return dict(
            target=QWEN3_4B,
            drafter=p["drafter"],
            selector=p["selector"],
            seqs=t["seqs_per_step"],
            seq_len=p["max_seq_len"],
            anchors=t["anchors_per_seq"],
            micro_batches=t["micro_batches"],
            chunk_tokens=t["chunk_tokens"],
        )
    return dict(
        target=QWEN3_TINY,
        drafter=dict(num_layers=1, target_layer_ids=[1, 3, 4], block_size=16, top_k=8),
        selector=dict(d_sel=32, read_dim=16, compact_dim=16, heads=2, history_len=16),
        seqs=2,
        seq_len=128,
        anchors=16,
        micro_batches=2,
        chunk_tokens=256,
    )


def _plan(target, module, st: mp.StepShape, selector_config: dict, device: str) -> mp.MemoryPlan:
    """The memory plan for exactly these modules (shapes read off them)."""
    c, dc = target.config, module.drafter.config
    t = mp.TargetShape(
        vocab=c.vocab_size,
        hidden=c.hidden_size,
        layers=c.num_hidden_layers,
        heads=c.num_attention_heads,
        kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        intermediate=c.intermediate_size,
        tied_embeddings=bool(c.tie_word_embeddings),
        bytes_per_param=2,
    )
    d = mp.DrafterShape(
        layers=dc.num_layers,
        hidden=dc.hidden_size,
        heads=dc.num_heads,
        kv_heads=dc.num_kv_heads,
        head_dim=dc.head_dim,
        intermediate=dc.intermediate_size,
        feature_layers=len(dc.target_layer_ids),
        block_size=dc.block_size,
        top_k=dc.top_k,
        draft_vocab=dc.draft_vocab_size,
    )
    sc = module.selector.config
    s = mp.SelectorShape(
        params=mp.count_selector_params("drelay", selector_config, drafter_shape=d, target=t),
        d=sc.d_sel,
        heads=sc.heads,
        read_dim=sc.read_dim,
        compact_dim=sc.compact_dim,
        history_len=sc.history_len,
    )
    return mp.estimate(t, d, s, st, attention=attention_path(device))


def _resident_bytes(*tensor_sources) -> int:
    """Bytes of the distinct storages behind the given tensors (weights, buffers, optimizer state)."""
    seen: dict[int, int] = {}
    for tensors in tensor_sources:
        for x in tensors:
            if torch.is_tensor(x) and x.device.type != "meta":
                seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
    return sum(seen.values())


def _one_step(target, module, optimizer, params, ids, mask, cfg: StepConfig, layers) -> tuple[float, float]:
    """Features (the target's no-grad forward under bf16 autocast, as pipelines/train/features.py),
    the joint step's forward + backward, clipping and the AdamW update → (loss, seconds)."""
    start = time.perf_counter()
    with torch.no_grad(), torch.autocast(ids.device.type, dtype=torch.bfloat16):
        out = target(
            ids,
            target.new_cache(*ids.shape),
            feature_layers=layers,
            logits_at=torch.zeros(ids.shape[0], 1, dtype=torch.long, device=ids.device),
        )
    feats = out.features.float()
    del out
    optimizer.zero_grad(set_to_none=True)
    res = training_step_backward(
        module, module, ids, mask, feats, cfg, torch.Generator().manual_seed(0), autocast_dtype=torch.bfloat16
    )
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    sync(ids.device)
    return float(res.loss), time.perf_counter() - start


def run(device: str, scale: str) -> dict:
    s = _setting(scale)
    target = random_qwen3_target(s["target"], device=device, dtype=torch.bfloat16)
    dc = DrafterConfig.for_target(
        target,
        num_layers=s["drafter"]["num_layers"],
        target_layer_ids=tuple(s["drafter"]["target_layer_ids"]),
        block_size=s["drafter"]["block_size"],
        top_k=s["drafter"]["top_k"],
    )
    torch.manual_seed(0)
    with torch.device(device):
        drafter = BlockDrafter(dc, target)
        selector = default_registry().create("drelay", drafter=drafter, config=s["selector"])
    module = DraftTrainModule(drafter, selector).to(device).train()
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (s["seqs"], s["seq_len"]), generator=g).to(device)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 64:] = True  # the response: anchors are drawn here
    cfg = StepConfig(
        anchors_per_seq=s["anchors"], native_fraction=0.5, micro_batches=s["micro_batches"], chunk_tokens=s["chunk_tokens"]
    )
    layers = dc.target_layer_ids
    step = lambda: _one_step(target, module, optimizer, params, ids, mask, cfg, layers)  # noqa: E731
    first_loss, first_s = step()  # creates AdamW's moments: the steady state the plan prices
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated()
        loss, seconds = step()
        peak = torch.cuda.max_memory_allocated()
    else:
        from drelay_model.training.memory_meter import measure_peak_bytes

        state = [t for st in optimizer.state.values() for t in st.values()]
        resident = _resident_bytes(
            target.parameters(), target.buffers(), module.parameters(), module.buffers(), state, [ids, mask]
        )
        above, (loss, seconds) = measure_peak_bytes(step)
        peak = resident + above
    st = mp.StepShape(
        seqs_per_step=s["seqs"],
        seq_len=s["seq_len"],
        anchors_per_seq=s["anchors"],
        micro_batches=s["micro_batches"],
        chunk_tokens=s["chunk_tokens"],
        bf16=True,
    )
    plan = _plan(target, module, st, s["selector"], device)
    ratio = peak / plan.total
    return {
        "shape": {k: v for k, v in s.items() if k != "target"}
        | {"target_layers": target.num_layers, "target_hidden": target.hidden_size},
        "params": {
            "drafter": sum(p.numel() for p in drafter.parameters()),
            "selector": sum(p.numel() for p in selector.parameters()),
        },
        "loss": [round(first_loss, 4), round(loss, 4)],
        "step_seconds": [round(first_s, 2), round(seconds, 2)],
        "resident_gib": round(resident / GiB, 3),
        "measured_peak_gib": round(peak / GiB, 3),
        "plan_total_gib": round(plan.total / GiB, 3),
        "plan_attention": plan.attention,
        "plan_components_gib": {k: round(v / GiB, 3) for k, v in plan.components.items()},
        "plan_activation_stages_gib": {k: round(v / GiB, 3) for k, v in plan.activation_stages.items()},
        "measured_over_plan": round(ratio, 3),
        "ok": bool(torch.isfinite(torch.tensor([first_loss, loss])).all()) and abs(ratio - 1) <= TOLERANCE,
    }
