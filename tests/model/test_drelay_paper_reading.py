"""DRelay's pieces against independent references: the soft candidate summary and
slot mixing, the λ fusion, what goes into a prefix-memory entry (the anchor's feature projection
included), what the history read sees, what the gate sees (`gate_evidence`), and how checkpoints
that predate these switches load."""

from __future__ import annotations

import pytest
import torch

from drelay_model.selectors.drelay import DRelayConfig
from drelay_model.selectors.drelay.causal import combine
from tests.model.test_drelay_selector import F_DIM, H, K, SMALL, context, make_selector, perturb, random_block


def _ln(x: torch.Tensor, norm: torch.nn.LayerNorm) -> torch.Tensor:
    """LayerNorm written out: (x − mean) / sqrt(var + eps) · γ + β."""
    mu, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    return (x - mu) / torch.sqrt(var + norm.eps) * norm.weight + norm.bias


# ---- what the gate sees ----------------------------------------------------------------------------
def _combine_reference(out, gate0, rank0, contrast):
    """Per slot, in plain Python: Δg = δ_K (+ Σ_{k≥1} r_k δ_k − δ_0), r = softmax over alternatives."""
    B, Hs, K1, _ = out.shape
    gate, rank = torch.empty(B, Hs), torch.empty(B, Hs, K1 - 1)
    for b in range(B):
        for i in range(Hs):
            S = [float(rank0[b, i, k] + out[b, i, k, 0]) for k in range(K1 - 1)]
            delta = float(out[b, i, K1 - 1, 1])
            if contrast:
                z = sum(torch.tensor(S[1:]).exp().tolist())
                delta += sum(torch.tensor(S[k]).exp().item() / z * float(out[b, i, k, 1]) for k in range(1, K1 - 1))
                delta -= float(out[b, i, 0, 1])
            gate[b, i], rank[b, i] = float(gate0[b, i]) + delta, torch.tensor(S)
    return gate, rank


@pytest.mark.parametrize("contrast", [True, False])
def test_combine_matches_a_per_slot_reference(contrast):
    g = torch.Generator().manual_seed(3)
    out, gate0, rank0 = (
        torch.randn(2, 3, K + 1, 2, generator=g),
        torch.randn(2, 3, generator=g),
        torch.randn(2, 3, K, generator=g),
    )
    gate, rank = combine(out, gate0, rank0, contrast=contrast)
    ref_gate, ref_rank = _combine_reference(out, gate0, rank0, contrast)
    torch.testing.assert_close(gate, ref_gate, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rank, ref_rank, atol=1e-5, rtol=1e-5)


def test_the_gate_sees_the_alternatives_evidence_only_with_contrast():
    g = torch.Generator().manual_seed(4)
    out, gate0, rank0 = torch.randn(1, 1, K + 1, 2, generator=g), torch.zeros(1, 1), torch.randn(1, 1, K, generator=g)
    bumped = out.clone()
    bumped[0, 0, 2, 1] += 5.0  # more gate evidence for alternative 2 only
    for contrast, moves in ((True, True), (False, False)):
        before, _ = combine(out, gate0, rank0, contrast=contrast)
        after, _ = combine(bumped, gate0, rank0, contrast=contrast)
        assert bool((after > before + 1e-3).all()) is moves
    native = out.clone()
    native[0, 0, 0, 1] += 5.0  # more evidence for the native candidate lowers the repair margin
    assert combine(native, gate0, rank0, contrast=True)[0] < combine(out, gate0, rank0, contrast=True)[0]


def test_model_gate_is_combine_of_the_compact_heads_output(monkeypatch):
    """The gate forward_train returns equals g⁰ + Δg of the reference, from the very `out` rows."""
    sel = perturb(make_selector(5), 5)
    block, ctx = random_block(2, 5), context(2, 5)
    seen = []
    original = sel.causal._corrections
    monkeypatch.setattr(sel.causal, "_corrections", lambda pre, read: seen.append(original(pre, read)) or seen[-1])
    with torch.no_grad():
        ev, _ = sel.evidence(block, ctx.history, ctx.history_mask)
        out = sel.forward_train(
            block,
            anchor_ids=ctx.anchor_ids,
            prefix_tokens=block.cand_ids[..., 0],
            history=ctx.history,
            history_mask=ctx.history_mask,
        )
    ref_gate, ref_rank = _combine_reference(seen[-1], ev.gate0, ev.rank0, contrast=True)
    torch.testing.assert_close(out.gate, ref_gate, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.rank, ref_rank, atol=1e-4, rtol=1e-4)


def test_a_fresh_selector_is_native_under_either_gate_reading():
    for gate_evidence in ("contrast", "slot"):
        sel = make_selector(6, gate_evidence=gate_evidence)
        block, ctx = random_block(3, 6), context(3, 6)
        ev, _ = sel.evidence(block, ctx.history, ctx.history_mask)
        out = sel.forward_train(
            block,
            anchor_ids=ctx.anchor_ids,
            prefix_tokens=block.cand_ids[..., 0],
            history=ctx.history,
            history_mask=ctx.history_mask,
        )
        torch.testing.assert_close(out.gate, ev.gate0)


# ---- Global Read: summary, slot mixing, λ fusion -----------------------------------------------
def test_slot_mixing_input_is_the_pool_renormalised_soft_summary():
    sel = make_selector(7, global_blocks=0)  # no mixing blocks: u = LN(s + W_m Σ_k π_ik ê_ik)
    gr, block = sel.global_read, random_block(2, 7)
    s = sel.slot_norm(sel.slot_in(block.hidden)) + sel.slot_pos
    emb = sel.embed(block.cand_ids)
    feats = gr(s, emb, block.cand_logq)
    for b in range(2):
        for i in range(H):
            q = block.cand_logq[b, i].exp()
            summary = sum(q[k] / q.sum() * emb[b, i, k] for k in range(K))
            u = _ln(s[b, i] + gr.mix_in.weight @ summary, gr.u_norm)
            torch.testing.assert_close(feats.z[b, i], s[b, i] + gr.fusion[i] * (gr.slot_out.weight @ u), atol=1e-5, rtol=1e-4)


def test_fusion_scalar_of_a_slot_scales_only_that_slots_residuals():
    sel = make_selector(8)
    gr, block = sel.global_read, random_block(1, 8)
    s = sel.slot_norm(sel.slot_in(block.hidden)) + sel.slot_pos
    emb = sel.embed(block.cand_ids)
    with torch.no_grad():
        base = gr(s, emb, block.cand_logq)
        gr.fusion[2] = 3.0
        scaled = gr(s, emb, block.cand_logq)
    others = [i for i in range(H) if i != 2]
    torch.testing.assert_close(scaled.z[:, others], base.z[:, others])
    torch.testing.assert_close(scaled.c[:, others], base.c[:, others])
    torch.testing.assert_close(scaled.z[:, 2] - s[:, 2], 3.0 * (base.z[:, 2] - s[:, 2]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(scaled.c[:, 2] - emb[:, 2], 3.0 * base.read[:, 2], atol=1e-5, rtol=1e-5)


# ---- prefix memory and history ---------------------------------------------------------------------
@pytest.mark.parametrize("anchor_feature", [True, False])
def test_prefix_memory_entries_hold_what_the_paper_lists(anchor_feature):
    """Entry j ≥ 1: LN(W_m[s_j; z_j] + p_j + W_x E(x_j)); entry 0: LN(g_a + p_0 (+ LN(W_F f_a)) + W_x E(x_0))."""
    sel = make_selector(9, anchor_feature=anchor_feature)
    c = sel.causal
    block, ctx = random_block(2, 9), context(2, 9)
    ctx.history_mask[1, -1] = False  # row 1 has no verified feature for its anchor
    with torch.no_grad():
        ev, cand_emb = sel.evidence(block, ctx.history, ctx.history_mask)
        k, v, _ = c.token_terms(ev.anchor, sel.embed(ctx.anchor_ids))
        W_x = c.tok_proj.weight[: SMALL["d_sel"]]
        for b in range(2):
            base = c.anchor_flag + c.mem_pos[0]
            if anchor_feature and b == 0:
                base = base + _ln(c.hist_in(ctx.history[b, -1]), c.hist_norm)
            m = _ln(base + W_x @ sel.embed(ctx.anchor_ids[b]), c.mem_norm)
            torch.testing.assert_close(torch.cat([k[b], v[b]]), c.mem_kv.weight @ m, atol=1e-5, rtol=1e-4)
        s = sel.slot_norm(sel.slot_in(block.hidden)) + sel.slot_pos
        z = sel.global_read(s, cand_emb, block.cand_logq).z
        j, pick = 3, 2
        m = _ln(c.mem_slot(torch.cat([s[0, j], z[0, j]])) + c.mem_pos[j + 1] + W_x @ cand_emb[0, j, pick], c.mem_norm)
        kj, vj, _ = c.token_terms(ev.slot_mem[0, j], cand_emb[0, j, pick])
        torch.testing.assert_close(torch.cat([kj, vj]), c.mem_kv.weight @ m, atol=1e-5, rtol=1e-4)


def test_the_anchor_feature_reaches_the_scores_only_when_enabled():
    """With no history read, f_a (the newest verified feature) can only act through the anchor entry."""
    for anchor_feature in (True, False):
        sel = perturb(make_selector(10, anchor_feature=anchor_feature, history_len=0), 10, gate_bias=2.0)
        block, ctx, moved = random_block(2, 10), context(2, 10), context(2, 10)
        moved.history[:, -1] += 3.0 * torch.randn(2, F_DIM, generator=torch.Generator().manual_seed(1))
        gates = []
        for c in (ctx, moved):
            with torch.no_grad():
                out = sel.forward_train(
                    block,
                    anchor_ids=c.anchor_ids,
                    prefix_tokens=block.cand_ids[..., 0],
                    history=c.history,
                    history_mask=c.history_mask,
                )
            gates.append(out.gate)
        assert torch.allclose(gates[0], gates[1]) is not anchor_feature


def test_history_read_sees_the_newest_real_entries_only():
    sel = perturb(make_selector(11), 11)
    block, ctx = random_block(2, 11), context(2, 11, masked=3)
    with torch.no_grad():
        ref = sel.evidence(block, ctx.history, ctx.history_mask)[0].pre
        masked_changed = ctx.history.clone()
        masked_changed[:, :3] = 100.0  # masked entries carry no information
        same = sel.evidence(block, masked_changed, ctx.history_mask)[0].pre
        longer = torch.cat([torch.randn(2, 5, F_DIM), ctx.history], dim=1)  # older than N: not read
        longer_mask = torch.cat([torch.ones(2, 5, dtype=torch.bool), ctx.history_mask], dim=1)
        trimmed = sel.evidence(block, longer, longer_mask)[0].pre
        real_changed = ctx.history.clone()
        real_changed[:, 4] += 1.0
        moved = sel.evidence(block, real_changed, ctx.history_mask)[0].pre
    torch.testing.assert_close(same, ref)
    torch.testing.assert_close(trimmed, ref)
    assert not torch.allclose(moved, ref)


def test_the_selector_asks_for_the_anchor_feature_even_without_a_history_read():
    assert make_selector(12, history_len=0).capabilities.history_len == 1
    assert make_selector(12, history_len=0, anchor_feature=False).capabilities.history_len == 0
    assert make_selector(12).capabilities.history_len == SMALL["history_len"]


# ---- checkpoints from before the switches ----------------------------------------------------------
def test_a_saved_config_without_the_new_keys_loads_as_it_was_trained():
    old = {k: v for k, v in DRelayConfig(**SMALL).to_dict().items() if k not in ("gate_evidence", "anchor_feature", "branches")}
    cfg = DRelayConfig.from_saved(old)
    assert (cfg.gate_evidence, cfg.anchor_feature) == ("slot", False)
    assert DRelayConfig.from_saved({**old, "gate_evidence": "contrast"}).gate_evidence == "contrast"
    assert (DRelayConfig.from_dict(old).gate_evidence, DRelayConfig.from_dict(old).anchor_feature) == ("contrast", True)
    trained = make_selector(13, gate_evidence="slot", anchor_feature=False, branches="shared")
    tensors = {f"selector.{k}": v for k, v in trained.state_dict().items()}

    class _Drafter:  # the two things `build` reads off a drafter
        embed_weight = trained.embed_weight
        config = type("C", (), {"num_slots": H, "top_k": K, "target_layer_ids": (0, 1), "hidden_size": F_DIM // 2})()

    from drelay_model.selectors import default_registry

    loaded = default_registry().from_checkpoint(
        "drelay", drafter=_Drafter(), tensors=tensors, meta={"selector": {"name": "drelay", "config": old}}
    )
    assert loaded.config.gate_evidence == "slot" and not loaded.causal.anchor_feature
    block, ctx = random_block(2, 13), context(2, 13)
    assert torch.equal(loaded.select(block, ctx).pool_index, trained.select(block, ctx).pool_index)


def test_bad_switch_values_are_named():
    from drelay_model.errors import DRelayError

    with pytest.raises(DRelayError, match="gate_evidence"):
        DRelayConfig(gate_evidence="both")
    with pytest.raises(DRelayError, match="anchor_feature"):
        DRelayConfig(anchor_feature="yes")
