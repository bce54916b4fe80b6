"""The drafter's block attention per device path (drelay_model/attention.py) against the reference
math, forward and backward, with the drafter's real mask layout (bidirectional inside a block,
strictly causal to the context); the CPU default path is the plain SDPA call, bit for bit; the
expanded (CUDA) path traces as one graph under torch.compile(fullgraph=True)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from drelay_model import attention as at
from drelay_model.drafter import BlockDrafter, DrafterConfig
from drelay_model.target import tiny_target

NH, NKV, HD = 6, 2, 16


def _block_mask(anchor_pos: torch.Tensor, C: int, S: int) -> torch.Tensor:
    """The drafter's own mask builder: [B, 1, M*S, C + M*S] bool."""
    return BlockDrafter._block_mask(None, anchor_pos, C, S)


def _qkv(B=2, M=3, S=4, C=11, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    Q, Ck = M * S, C + M * S
    q = torch.randn(B, NH, Q, HD, generator=g, dtype=dtype).requires_grad_()
    k = torch.randn(B, NKV, Ck, HD, generator=g, dtype=dtype).requires_grad_()
    v = torch.randn(B, NKV, Ck, HD, generator=g, dtype=dtype).requires_grad_()
    anchor_pos = torch.tensor([[2, 7, 11], [0, 5, 9]])[:B, :M]
    return q, k, v, _block_mask(anchor_pos, C, S), anchor_pos


def _reference(q, k, v, mask):
    g = q.shape[1] // k.shape[1]
    return at.reference_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), mask)


def _run(path, q, k, v, mask):
    out = at.attend(q, k, v, at.prepare_mask(mask, path, q.dtype), path)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    return out, grads


def test_the_mask_is_bidirectional_in_a_block_and_strictly_causal_to_the_context():
    C, S = 11, 4
    anchor_pos = torch.tensor([[2, 7, 11]])
    mask = _block_mask(anchor_pos, C, S)[0, 0]  # [M*S, C + M*S]
    for qi in range(3 * S):
        m = qi // S
        ctx = mask[qi, :C].nonzero().flatten().tolist()
        blk = (mask[qi, C:].nonzero().flatten() // S).tolist()
        assert ctx == list(range(int(anchor_pos[0, m])))  # context positions p < anchor only
        assert blk == [m] * S  # every position of its own block, none of another


@pytest.mark.parametrize("path", [at.SDPA_GQA, at.SDPA_EXPANDED, at.MATH])
def test_each_path_equals_the_reference_math_forward_and_backward(path):
    q, k, v, mask, _ = _qkv()
    out, grads = _run(path, q, k, v, mask)
    ref = _reference(q, k, v, mask)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_the_expanded_path_in_bf16_matches_the_float32_reference():
    q, k, v, mask, _ = _qkv()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bias = at.prepare_mask(mask, at.SDPA_EXPANDED, at.compute_dtype(q))
        out = at.attend(q, k, v, bias, at.SDPA_EXPANDED)
    assert bias.dtype == torch.bfloat16 and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _reference(q, k, v, mask), atol=3e-2, rtol=3e-2)


def test_the_cpu_default_is_the_plain_sdpa_call_bit_for_bit():
    q, k, v, mask, _ = _qkv()
    assert at.attention_path("cpu") == at.SDPA_GQA and at.prepare_mask(mask, at.SDPA_GQA, q.dtype) is mask
    plain = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert torch.equal(at.attend(q, k, v, mask, at.SDPA_GQA), plain)


def test_the_path_is_chosen_per_device_and_can_be_forced():
    assert at.attention_path(torch.device("cuda", 3)) == at.SDPA_EXPANDED
    assert at.attention_path("cuda") == at.SDPA_EXPANDED and at.attention_path("meta") == at.SDPA_GQA
    with at.forced_attention_path(at.MATH):
        assert at.attention_path("cpu") == at.attention_path("cuda") == at.MATH
    assert at.attention_path("cpu") == at.SDPA_GQA
    with pytest.raises(ValueError, match="attention path must be one of"):
        with at.forced_attention_path("flash"):
            pass


def test_the_bias_is_built_once_with_aligned_rows():
    _, _, _, mask, _ = _qkv(C=11)  # Ck = 23 keys: rows padded to 32 in storage
    bias = at.prepare_mask(mask, at.SDPA_EXPANDED, torch.bfloat16)
    assert bias.shape == mask.shape and bias.stride(-2) % 16 == 0
    assert bool((bias == 0).eq(mask).all()) and bool(torch.isneginf(bias[~mask]).all())


def _drafter_batch():
    target = tiny_target("tiny-qwen3", vocab=256, hidden=64, heads=4, kv_heads=2)
    torch.manual_seed(0)
    drafter = BlockDrafter(DrafterConfig.for_target(target, num_layers=2, block_size=8), target).train()
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    feats = target(ids, target.new_cache(2, 40), feature_layers=drafter.config.target_layer_ids).features
    anchors = torch.tensor([[3, 17, 30, 39], [0, 8, 9, 25]])
    return drafter, ids.gather(1, anchors), anchors, feats


@pytest.mark.parametrize("path", [at.SDPA_EXPANDED, at.MATH])
def test_the_drafter_gives_the_same_blocks_and_gradients_on_every_path(path):
    """The whole training forward (many blocks, masked, grouped heads) and its parameter gradients
    on a forced path equal the CPU default's."""
    drafter, anchor_ids, anchors, feats = _drafter_batch()

    def blocks_and_grads():
        drafter.zero_grad()
        h = drafter(anchor_ids, anchors, feats)
        h.square().mean().backward()
        return h.detach(), [p.grad.clone() for p in drafter.parameters()]

    h0, g0 = blocks_and_grads()
    with at.forced_attention_path(path):
        h1, g1 = blocks_and_grads()
    torch.testing.assert_close(h1, h0, atol=1e-5, rtol=1e-5)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_the_drafter_on_the_expanded_path_compiles_as_one_graph():
    """torch.compile(fullgraph=True) traces the drafter's training forward on the expanded (CUDA)
    path, the path choice, mask and bias included, with no graph break, and its forward and
    backward equal eager (aot_eager: tracing and autograd, no C++ code generation on CPU)."""
    drafter, anchor_ids, anchors, feats = _drafter_batch()
    with at.forced_attention_path(at.SDPA_EXPANDED):
        eager = drafter(anchor_ids, anchors, feats)
        eager_grads = torch.autograd.grad(eager.square().mean(), list(drafter.parameters()))
        compiled = torch.compile(drafter, fullgraph=True, backend="aot_eager")(anchor_ids, anchors, feats)
        grads = torch.autograd.grad(compiled.square().mean(), list(drafter.parameters()))
    torch.testing.assert_close(compiled, eager)
    for got, want in zip(grads, eager_grads):
        torch.testing.assert_close(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_runs_the_memory_efficient_kernel_with_the_mask_and_grouped_heads():
    """On CUDA the expanded path runs under SDPA's memory-efficient kernel only (a fallback would
    raise) and equals the reference math in bf16, forward and backward."""
    q, k, v, mask, _ = (
        t.detach().cuda().to(torch.bfloat16).requires_grad_() if t.is_floating_point() else t.cuda()
        for t in _qkv(B=2, M=3, S=16, C=200)
    )
    assert at.attention_path(q.device) == at.SDPA_EXPANDED
    out, grads = _run(at.SDPA_EXPANDED, q, k, v, mask)
    ref = _reference(q.float(), k.float(), v.float(), mask)
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.float(), want.float(), atol=1e-1, rtol=5e-2)
    # Without a mask (decode) the flash kernel takes the grouped heads as they are.
    q1 = q[:, :, :1].detach()
    out = at.attend(q1, k.detach(), v.detach(), None, at.SDPA_EXPANDED)
    torch.testing.assert_close(out.float(), _reference(q1.float(), k.float(), v.float(), None), atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_drafter_under_bf16_autocast_compiles_as_one_graph():
    """The CUDA path (memory-efficient kernel chosen inside the traced code) compiles with
    fullgraph=True and matches eager under bf16 autocast, forward and backward."""
    drafter, anchor_ids, anchors, feats = (x.cuda() for x in _drafter_batch())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager = drafter(anchor_ids, anchors, feats)
        compiled = torch.compile(drafter, fullgraph=True)(anchor_ids, anchors, feats)
    assert at.attention_path(feats.device) == at.SDPA_EXPANDED
    torch.testing.assert_close(compiled.float(), eager.float(), atol=5e-2, rtol=5e-2)
    compiled.float().square().mean().backward()
    assert all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in drafter.parameters())
