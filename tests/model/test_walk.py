"""The graph-safe decision walk: the same decisions as `decide_block` (and the literal loop) on
random, tied and edge-case inputs, and it compiles as one graph (`fullgraph=True`)."""

from __future__ import annotations

import pytest
import torch

from drelay_model.selectors.drelay import DRelayConfig, DRelaySelector
from drelay_model.selectors.drelay.walk import walk, walk_inputs
from tests.model.test_drelay_selector import D, F_DIM, SMALL, V, context, perturb, random_block


def make(seed: int, *, H: int, K: int, **overrides) -> DRelaySelector:
    torch.manual_seed(seed)
    cfg = DRelayConfig(**{**SMALL, **overrides})
    return DRelaySelector(cfg, embed_weight=torch.randn(V, D), num_slots=H, top_k=K, feature_dim=F_DIM).eval()


def block_and_ctx(B: int, seed: int, *, H: int, K: int, ties: bool):
    g = torch.Generator().manual_seed(seed)
    logq = torch.log_softmax(torch.randn(B, H, V, generator=g) * 2.5, dim=-1)
    cand_logq, cand_ids = logq.topk(K, dim=-1)
    if ties:  # every alternative exactly as likely as the native candidate, and repeated tokens
        cand_logq[..., 1:] = cand_logq[..., :1]
        cand_ids[..., -1] = cand_ids[..., 0]
    from drelay_model.drafter import DraftBlock

    block = DraftBlock(hidden=torch.randn(B, H, D, generator=g), cand_ids=cand_ids, cand_logq=cand_logq)
    ctx = context(B, seed)
    return block, ctx


def both(sel: DRelaySelector, block, ctx):
    ev, cand_emb = sel.evidence(block, ctx.history, ctx.history_mask)
    anchor = sel.embed(ctx.anchor_ids)
    with torch.inference_mode():
        ref = sel.causal.decide_block(ev, anchor, cand_emb)
        got = walk(walk_inputs(sel.causal, ev, anchor, cand_emb))
    return ref, got


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("shape", [(6, 5), (1, 2), (4, 2), (9, 7)])
def test_walk_equals_decide_block(ties, shape):
    H, K = shape
    repairs = 0
    for seed, gate_bias in enumerate([0.0, 1.0, 3.0, 8.0, 3.0]):
        sel = perturb(
            make(seed, H=H, K=K, global_read=seed % 3 != 0, history_len=0 if seed == 4 else 8), seed, gate_bias=gate_bias
        )
        B = 1 + seed % 4
        block, ctx = block_and_ctx(B, seed, H=H, K=K, ties=ties)
        (pick, gate, rank), got = both(sel, block, ctx)
        assert torch.equal(got.pool_index, pick)
        torch.testing.assert_close(got.gate, gate, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.rank, rank, atol=1e-5, rtol=1e-5)
        repairs += int(pick.ne(0).sum())
    if not ties:
        assert repairs > 0  # the comparison covers REPAIR decisions, not only KEEP


def test_fresh_selector_walk_keeps_the_native_path():
    sel = make(0, H=6, K=5)
    for ties in (False, True):
        block, ctx = block_and_ctx(3, 1, H=6, K=5, ties=ties)
        (pick, _, _), got = both(sel, block, ctx)
        assert got.pool_index.eq(0).all() and pick.eq(0).all()


def test_select_uses_the_walk_by_default_and_passes_on_request():
    sel = perturb(make(2, H=6, K=5), 3, gate_bias=3.0)
    passes = perturb(make(2, H=6, K=5, decisions="passes"), 3, gate_bias=3.0)
    assert sel.config.decisions == "walk"
    for seed in range(4):
        block, ctx = random_block(3, seed), context(3, seed)
        a, b = sel.select_with_scores(block, ctx), passes.select_with_scores(block, ctx)
        assert torch.equal(a.selection.path_ids, b.selection.path_ids)
        torch.testing.assert_close(a.output.rank, b.output.rank, atol=1e-5, rtol=1e-5)


def test_walk_compiles_as_one_graph_and_decide_block_does_not():
    torch._dynamo.reset()
    sel = perturb(make(1, H=6, K=5), 1, gate_bias=3.0)
    block, ctx = block_and_ctx(2, 7, H=6, K=5, ties=False)
    ev, cand_emb = sel.evidence(block, ctx.history, ctx.history_mask)
    anchor = sel.embed(ctx.anchor_ids)
    with torch.no_grad():
        w = walk_inputs(sel.causal, ev, anchor, cand_emb)
        compiled = torch.compile(walk, fullgraph=True, backend="aot_eager")
        got, ref = compiled(w), walk(w)
        assert torch.equal(got.pool_index, ref.pool_index)
        torch.testing.assert_close(got.gate, ref.gate, atol=1e-6, rtol=1e-6)
        # The negative control: the early-exit passes end in a host sync and cannot be one graph.
        bad = torch.compile(sel.causal.decide_block, fullgraph=True, backend="aot_eager")
        with pytest.raises(Exception):
            bad(ev, anchor, cand_emb)
    torch._dynamo.reset()


@pytest.mark.parametrize(
    "overrides", [{}, {"decisions": "passes"}, {"gate_evidence": "slot", "anchor_feature": False}, {"global_read": False}]
)
def test_deciding_the_first_p_slots_equals_the_full_walk_cut_at_p(overrides):
    """`SelectionContext.max_slots` = P (cost-aware length verifies at most P drafts): the selector
    decides only slots 0..P−1, and those decisions and scores are the full walk's first P; past P
    it keeps the native candidate and reports length P."""
    import dataclasses

    H, K = 6, 5
    sel = perturb(make(5, H=H, K=K, **overrides), 5, gate_bias=3.0)
    block, ctx = block_and_ctx(3, 7, H=H, K=K, ties=False)
    full = sel.select_with_scores(block, ctx)
    assert full.selection.pool_index.ne(0).any()  # REPAIR decisions are part of the comparison
    for P in range(1, H + 1):
        cut = sel.select_with_scores(block, dataclasses.replace(ctx, max_slots=P))
        assert torch.equal(cut.selection.pool_index[:, :P], full.selection.pool_index[:, :P])
        assert cut.selection.pool_index[:, P:].eq(0).all()
        assert cut.selection.length.tolist() == [P] * 3
        torch.testing.assert_close(cut.output.gate[:, :P], full.output.gate[:, :P], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cut.output.rank[:, :P], full.output.rank[:, :P], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="max_slots"):  # the context owns the bound
        dataclasses.replace(ctx, max_slots=0)
