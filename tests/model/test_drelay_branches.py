"""The paper's separate KEEP/REPAIR and ranking branches (§5: "The selector has separate KEEP/REPAIR
and ranking branches"), the shared-MLP reading older checkpoints were trained with, and the scout
that follows the selector by default (§5: "the scout and incremental native selection see the same
earlier tokens")."""

from __future__ import annotations

import math

import pytest
import torch

from drelay_model.selectors.drelay import DRelayConfig
from drelay_model.selectors.drelay.causal import BranchHeads
from drelay_model.selectors.drelay.walk import walk, walk_inputs
from tests.model.test_drelay_selector import H, K, SMALL, context, make_selector, perturb, random_block

C = SMALL["compact_dim"]


def _gelu(x: float) -> float:
    return 0.5 * x * (1.0 + math.erf(x / math.sqrt(2.0)))


def test_branch_heads_on_a_hand_computed_case():
    """C = 2: rank reads units 0-1 only, gate units 2-3 only.
    rank = 1·0.5 + (−2)·1 + 0.25 = −1.25;  gate = 3·(−1) + 0.5·4 − 1 = −2."""
    head = BranchHeads(2)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[0.5, 1.0], [-1.0, 4.0]]))
        head.bias.copy_(torch.tensor([0.25, -1.0]))
    out = head(torch.tensor([1.0, -2.0, 3.0, 0.5]))
    assert out.tolist() == [-1.25, -2.0]
    assert head.dense().tolist() == [[0.5, 1.0, 0.0, 0.0], [0.0, 0.0, -1.0, 4.0]]


def _branch_reference(causal, pre: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
    """Two MLPs written out unit by unit, each from its own slice of the parameters:
    ρ' = Σ_c w_ρ[c]·GELU(pre[c] + Σ_j W_c[c, j] o[j]) + b_ρ over the rank units c < C, δ likewise over
    the gate units C ≤ c < 2C with w_δ, b_δ."""
    W_c, w, b = (t.detach() for t in (causal.prefix_out.weight, causal.head.weight, causal.head.bias))
    out = torch.empty(*pre.shape[:-1], 2)
    for idx in torch.cartesian_prod(*(torch.arange(n) for n in pre.shape[:-1])).view(-1, pre.dim() - 1).tolist():
        p, o = pre[tuple(idx)].tolist(), read[tuple(idx)].tolist()
        for branch, units in ((0, range(0, C)), (1, range(C, 2 * C))):
            total = float(b[branch].detach())
            for n, c in enumerate(units):
                total += float(w[branch, n]) * _gelu(p[c] + sum(float(W_c[c, j]) * o[j] for j in range(len(o))))
            out[tuple(idx)][branch] = total
    return out


def test_separate_branches_match_two_independent_mlps():
    sel = perturb(make_selector(21), 21)
    assert sel.config.branches == "separate" and sel.causal.static_a.out_features == 2 * C
    g = torch.Generator().manual_seed(21)
    pre, read = torch.randn(2, 3, 2 * C, generator=g), torch.randn(2, 3, SMALL["read_dim"], generator=g)
    with torch.no_grad():
        got = sel.causal._corrections(pre, read)
    torch.testing.assert_close(got, _branch_reference(sel.causal, pre, read), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("branches", ["separate", "shared"])
def test_the_gate_branch_moves_the_rank_only_when_shared(branches):
    """Changing the gate's output row (and, separate, its own hidden units) never moves a rank score
    when the branches are separate; with one shared MLP the gate's input units feed the rank too."""
    sel = perturb(make_selector(22, branches=branches, gate_evidence="slot"), 22)
    block, ctx = random_block(2, 22), context(2, 22)
    prefix = block.cand_ids[..., 0]
    with torch.no_grad():
        before = sel.forward_train(
            block, anchor_ids=ctx.anchor_ids, prefix_tokens=prefix, history=ctx.history, history_mask=ctx.history_mask
        )
        units = slice(C, 2 * C) if branches == "separate" else slice(0, C)
        sel.causal.static_a.weight[units] += 0.7  # the gate branch's units (shared: the only units)
        sel.causal.head.bias[1] += 1.0
        after = sel.forward_train(
            block, anchor_ids=ctx.anchor_ids, prefix_tokens=prefix, history=ctx.history, history_mask=ctx.history_mask
        )
    assert not torch.allclose(after.gate, before.gate)
    assert torch.equal(after.rank, before.rank) is (branches == "separate")


@pytest.mark.parametrize("branches", ["separate", "shared"])
def test_all_decision_paths_agree_under_either_branching(branches):
    """sequential (the literal loop), decide_block and the walk reach the same decisions."""
    sel = perturb(make_selector(23, branches=branches), 23, gate_bias=2.0)
    block, ctx = random_block(3, 23), context(3, 23)
    with torch.inference_mode():
        ev, cand_emb = sel.evidence(block, ctx.history, ctx.history_mask)
        anchor = sel.embed(ctx.anchor_ids)
        seq = sel.causal.sequential(ev, anchor, cand_emb)
        blk = sel.causal.decide_block(ev, anchor, cand_emb)
        wlk = walk(walk_inputs(sel.causal, ev, anchor, cand_emb))
    assert int((seq[0] > 0).sum()) > 0  # repairs happen: the comparison is not all-KEEP
    assert torch.equal(seq[0], blk[0]) and torch.equal(seq[0], wlk.pool_index)
    torch.testing.assert_close(wlk.gate, seq[1], atol=1e-5, rtol=1e-5)


def test_a_fresh_selector_is_native_under_either_branching():
    for branches in ("separate", "shared"):
        sel = make_selector(24, branches=branches)
        block, ctx = random_block(2, 24), context(2, 24)
        assert int(sel.select(block, ctx).pool_index.abs().sum()) == 0


def test_a_saved_config_without_branches_loads_as_shared_and_decides_as_trained():
    old = {k: v for k, v in DRelayConfig(**SMALL).to_dict().items() if k != "branches"}
    assert DRelayConfig.from_saved(old).branches == "shared" and DRelayConfig.from_dict(old).branches == "separate"
    trained = perturb(make_selector(25, branches="shared"), 25, gate_bias=2.0)
    tensors = {f"selector.{k}": v for k, v in trained.state_dict().items()}

    class _Drafter:  # the two things `build` reads off a drafter
        embed_weight = trained.embed_weight
        config = type("C", (), {"num_slots": H, "top_k": K, "target_layer_ids": (0, 1), "hidden_size": 24})()

    from drelay_model.selectors import default_registry

    loaded = default_registry().from_checkpoint(
        "drelay", drafter=_Drafter(), tensors=tensors, meta={"selector": {"name": "drelay", "config": old}}
    )
    assert loaded.config.branches == "shared"
    block, ctx = random_block(3, 25), context(3, 25)
    assert torch.equal(loaded.select(block, ctx).pool_index, trained.select(block, ctx).pool_index)


def test_bad_branches_value_is_named():
    from drelay_model.errors import DRelayError

    with pytest.raises(DRelayError, match="branches"):
        DRelayConfig(branches="both")


def test_eq1_reads_use_four_heads_by_default():
    """§4.2: "each of four attention heads computes" Eq. 1."""
    assert DRelayConfig().heads == 4


# ---- the scout follows the selector by default -----------------------------------------------------
def test_the_default_scout_follows_the_selector_and_falls_back_to_the_argmax(target, make_drafter, monkeypatch):
    """Default StepConfig: the scout asks the selector's teacher-forced path (whose accepted count is
    what incremental selection accepts, tested in test_drelay_selector) and plans exactly what an
    explicit `selector` policy plans; `native` never asks it; a selector without a teacher-forced
    path is scouted by the argmax."""
    from drelay_model.selectors import default_registry
    from drelay_model.training.step import DraftTrainModule, StepConfig, _plan
    from tests.model.test_training import _data

    drafter = make_drafter(target, num_layers=1, top_k=8)
    selector = default_registry().create(
        "drelay", drafter=drafter, config={"d_sel": 32, "read_dim": 32, "compact_dim": 16, "history_len": 8}
    )
    perturb(selector, 26, gate_bias=6.0).eval()
    calls = []
    original = selector.teacher_forced_path
    monkeypatch.setattr(selector, "teacher_forced_path", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    _, _, ids, mask = _data(target, n=3, new=30)
    feats = target(ids, target.new_cache(3, ids.shape[1]), feature_layers=drafter.config.target_layer_ids).features

    def anchors(module, **policy):
        cfg = StepConfig(anchors_per_seq=8, native_fraction=1.0, scout_restart=True, **policy)
        calls.clear()
        planned = _plan(module, ids, mask, feats, ids, cfg, torch.Generator().manual_seed(0)).anchors
        return planned, len(calls)

    module = DraftTrainModule(drafter, selector)
    (default, asked), (follows, _), (native, asked_native) = (
        anchors(module),
        anchors(module, scout_policy="selector"),
        anchors(module, scout_policy="native"),
    )
    assert asked > 0 and asked_native == 0 and torch.equal(default, follows)
    dcoco = default_registry().create("dcoco", drafter=drafter)
    assert not dcoco.capabilities.teacher_forced
    assert torch.equal(anchors(DraftTrainModule(drafter, dcoco))[0], native)
