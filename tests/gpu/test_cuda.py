"""On a CUDA device: losslessness for every selector (fp32 and bf16 targets), per-request sampling,
one bf16 joint step, and the memory planner against torch.cuda.max_memory_allocated (±15%).

Run by benchmarks/gpu_check.sh; skipped (with the reason) on machines without CUDA."""

from __future__ import annotations

import pytest
import torch

from drelay_model.attention import attention_path
from drelay_model.decoding import GenerationConfig, SpeculativeEngine
from drelay_model.drafter import BlockDrafter, DrafterConfig
from drelay_model.selectors import default_registry
from drelay_model.target import load_target
from drelay_model.training import memory_plan as mp
from drelay_model.training.step import DraftTrainModule, StepConfig, training_step_backward

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

METHODS = ["ar", *default_registry().names()]


def _engine(target, method):
    if method == "ar":
        return SpeculativeEngine(target)
    torch.manual_seed(0)
    drafter = BlockDrafter(DrafterConfig.for_target(target, num_layers=1), target).to(device=target.device, dtype=target.dtype)
    return SpeculativeEngine(
        target, drafter, default_registry().create(method, drafter=drafter).to(device=target.device, dtype=target.dtype)
    )


def _prompts(vocab):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 9, 3, 12)]


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("method", METHODS)
def test_fp32_cuda_output_equals_huggingface_generate(arch, method):
    target = load_target(arch, device="cuda")
    prompts = _prompts(target.vocab_size)
    out = _engine(target, method).generate(prompts, GenerationConfig(max_new_tokens=40)).tokens
    for p, o in zip(prompts, out):
        ref = target.hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=40, do_sample=False, pad_token_id=0)[
            0, len(p) :
        ]
        assert o == ref.tolist()


@pytest.mark.parametrize("method", METHODS)
def test_bf16_cuda_tokens_are_the_targets_greedy_tokens(method):
    target = load_target("tiny-qwen3", device="cuda", dtype="bfloat16")
    prompts = _prompts(target.vocab_size)
    out = _engine(target, method).generate(prompts, GenerationConfig(max_new_tokens=24)).tokens
    for p, o in zip(prompts, out):
        logits = target.hf(torch.tensor([p + o], device="cuda")).logits[0, len(p) - 1 : -1].float()
        chosen = logits.gather(1, torch.tensor(o, device="cuda")[:, None])[:, 0]
        assert bool((chosen >= logits.max(dim=1).values - 0.15).all())


def test_cuda_sampling_is_per_request():
    target = load_target("tiny-qwen3", device="cuda")
    engine = _engine(target, "native")
    prompts, cfg = _prompts(target.vocab_size), GenerationConfig(max_new_tokens=20, temperature=1.0)
    batch = engine.generate(prompts, cfg, seeds=[1, 2, 3, 4]).tokens
    assert batch == [engine.generate([p], cfg, seeds=[s]).tokens[0] for p, s in zip(prompts, [1, 2, 3, 4])]


def _step_setup(vocab=16384, hidden=128, N=256, M=32, B=4):
    target = load_target(f"tiny-qwen3:vocab={vocab},hidden={hidden},layers=2,heads=4,kv_heads=2", device="cuda", dtype="bfloat16")
    torch.manual_seed(0)
    dc = DrafterConfig.for_target(target, num_layers=1, top_k=8)
    drafter = BlockDrafter(dc, target).cuda()
    sel_cfg = {"d_sel": 32, "read_dim": 32, "compact_dim": 16, "history_len": 16, "heads": 4}
    selector = default_registry().create("drelay", drafter=drafter, config=sel_cfg).cuda()
    module = DraftTrainModule(drafter, selector).train()
    ids = torch.randint(0, vocab, (B, N), device="cuda")
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 8:] = True
    with torch.autocast("cuda", dtype=torch.bfloat16):
        feats = target(ids, target.new_cache(B, N), feature_layers=dc.target_layer_ids).features
    return target, module, ids, mask, feats, dc, sel_cfg


def test_bf16_joint_step_on_cuda():
    _, module, ids, mask, feats, _, _ = _step_setup()
    cfg = StepConfig(anchors_per_seq=32, native_fraction=0.3, micro_batches=2, chunk_tokens=512)
    out = training_step_backward(
        module, module, ids, mask, feats, cfg, torch.Generator().manual_seed(0), autocast_dtype=torch.bfloat16
    )
    assert torch.isfinite(out.loss) and all(p.grad is not None and p.grad.is_cuda for p in module.parameters())


def test_plan_matches_cuda_max_memory_allocated_within_15_percent():
    vocab, hidden, N, M, B = 16384, 128, 256, 32, 4
    _, module, ids, mask, feats, dc, sel_cfg = _step_setup(vocab, hidden, N, M, B)
    cfg = StepConfig(anchors_per_seq=M, native_fraction=0.0, micro_batches=2, chunk_tokens=512)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    training_step_backward(module, module, ids, mask, feats, cfg, torch.Generator().manual_seed(0), autocast_dtype=torch.bfloat16)
    measured = torch.cuda.max_memory_allocated() - base
    ts = mp.TargetShape(vocab, hidden, 2, 4, 2, hidden // 4, 2 * hidden)
    ds = mp.DrafterShape(1, hidden, 4, 2, hidden // 4, 2 * hidden, len(dc.target_layer_ids), 16, 8)
    ss = mp.SelectorShape(
        params=mp.count_selector_params("drelay", sel_cfg, drafter_shape=ds, target=ts),
        d=32,
        heads=4,
        read_dim=32,
        compact_dim=16,
        history_len=16,
    )
    stages = mp._drafter_step_activations(ts, ds, ss, mp.StepShape(B, N, M, 2, 512, bf16=True), attention_path("cuda"))
    estimate = mp.step_peak(stages) + 4 * sum(p.numel() for p in module.parameters())
    print(f"\nplan vs CUDA: estimate {estimate / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB")
    assert 0.85 <= estimate / measured <= 1.15
