"""Triton kernels vs their PyTorch references: Global Read's candidate attention and the causal
decision walk, random shapes, float32 and bfloat16. Inputs go to DEVICE: compiled kernels on CUDA
tensors where a GPU is present (benchmarks/gpu_check.sh runs this file there), CPU tensors under
TRITON_INTERPRET=1 elsewhere."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # must be set before any kernel is defined
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from drelay_model.drafter import DraftBlock  # noqa: E402
from drelay_model.kernels.candidate_read import candidate_attention  # noqa: E402
from drelay_model.kernels.walk import walk_triton  # noqa: E402
from drelay_model.selectors import SelectionContext  # noqa: E402
from drelay_model.selectors.drelay import DRelayConfig, GlobalRead  # noqa: E402
from drelay_model.selectors.drelay.walk import WalkInputs, walk, walk_inputs  # noqa: E402
from tests.model.test_drelay_selector import context, perturb, random_block  # noqa: E402
from tests.model.test_walk import block_and_ctx, make  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(3))
def test_candidate_attention_matches_the_reference(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    B, nh, H, K, dg = 1 + seed, [1, 2, 4][seed], [3, 6, 5][seed], [2, 5, 4][seed], [4, 8, 20][seed]
    gr = GlobalRead(DRelayConfig(d_sel=16, heads=nh, read_dim=nh * dg), num_slots=H, top_k=K)
    with torch.no_grad():
        gr.rel_bias.copy_(torch.randn(nh, 2 * H - 1, generator=g))
    # Inputs rounded to `dtype` once; the reference computes in float32 on the rounded values.
    q, k, v = (torch.randn(B, nh, H * K, dg, generator=g).to(dtype) for _ in range(3))
    logq = torch.log_softmax(torch.randn(B, H, K, generator=g) * 3, dim=-1).to(dtype)
    with torch.no_grad():
        gr.rel_bias.copy_(gr.rel_bias.to(dtype).float())
    mask = torch.rand(B, H, K, generator=g) > 0.3
    mask[0] = False  # row 0 has no usable evidence: its reads must be exactly zero
    for key_mask in (None, mask):
        ref = gr.attend(q.float(), k.float(), v.float(), logq.float(), key_mask)
        dev = [t.to(DEVICE) for t in (q, k, v, logq)]
        got = candidate_attention(*dev, gr.rel_bias.detach().to(DEVICE, dtype), None if key_mask is None else key_mask.to(DEVICE))
        assert got.dtype == dtype
        torch.testing.assert_close(got.float().cpu(), ref, **TOL[dtype])
        if key_mask is not None:
            assert got[0].eq(0).all()


def _cast(w: WalkInputs, dtype) -> WalkInputs:
    return WalkInputs(**{f: (v.detach().to(DEVICE, dtype) if torch.is_tensor(v) else v) for f, v in vars(w).items()})


@pytest.mark.parametrize("gate_evidence", ["contrast", "slot"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(6, 5), (1, 2), (9, 3)])
def test_walk_kernel_matches_the_reference(dtype, shape, gate_evidence):
    H, K = shape
    repairs = 0
    for seed, (gate_bias, ties) in enumerate([(0.0, False), (3.0, False), (8.0, True), (3.0, True)]):
        sizes = dict(heads=[1, 2, 4][seed % 3], read_dim=8 if seed % 2 else 12, gate_evidence=gate_evidence)
        sel = perturb(make(seed, H=H, K=K, **sizes), seed, gate_bias=gate_bias)
        block, ctx = block_and_ctx(1 + seed % 3, seed, H=H, K=K, ties=ties)
        with torch.no_grad():
            ev, cand_emb = sel.evidence(block, ctx.history, ctx.history_mask)
            w = _cast(walk_inputs(sel.causal, ev, sel.embed(ctx.anchor_ids), cand_emb), dtype)
            ref = walk(_cast(w, torch.float32))  # float32 math on the same (rounded) inputs
            got = walk_triton(w)
        assert torch.equal(got.pool_index.cpu(), ref.pool_index.cpu())
        assert got.gate.dtype == dtype
        torch.testing.assert_close(got.gate.float().cpu(), ref.gate.cpu(), **TOL[dtype])
        torch.testing.assert_close(got.rank.float().cpu(), ref.rank.cpu(), **TOL[dtype])
        repairs += int(ref.pool_index.ne(0).sum())
    assert H == 1 or repairs > 0


def _on_device(block: DraftBlock, ctx: SelectionContext) -> tuple[DraftBlock, SelectionContext]:
    """The kernels' device: a compiled kernel takes CUDA tensors only (CPU ones run interpreted)."""
    move = lambda obj: type(obj)(**{f: (v.to(DEVICE) if torch.is_tensor(v) else v) for f, v in vars(obj).items()})  # noqa: E731
    return move(block), move(ctx)


def test_selector_with_triton_kernels_selects_like_torch():
    torch_sel = perturb(make(3, H=6, K=5), 4, gate_bias=3.0).to(DEVICE)
    triton_sel = perturb(make(3, H=6, K=5, kernels="triton"), 4, gate_bias=3.0).to(DEVICE)
    for seed in range(2):
        block, ctx = _on_device(random_block(2, seed), context(2, seed))
        a, b = torch_sel.select_with_scores(block, ctx), triton_sel.select_with_scores(block, ctx)
        assert torch.equal(a.selection.path_ids, b.selection.path_ids)
        torch.testing.assert_close(a.output.gate, b.output.gate, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.output.rank, b.output.rank, atol=1e-5, rtol=1e-5)
