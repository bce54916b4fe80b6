"""DRelay behind SGLang's selector seam: the same path as our engine's selector for the same pool,
anchor and verified history (history kept by the per-request ring), point-mass q rows, one graph."""

from __future__ import annotations

import pytest
import torch

from deploy.sglang.history import RequestFeatureRing
from deploy.sglang.model import DRelayDraftModel
from deploy.sglang.seam import DRelayCandidateSelector
from drelay_model.decoding.history import VerifiedHistory
from drelay_model.selectors import SelectionContext
from tests.model.test_drelay_selector import F_DIM, SMALL, perturb, random_block
from tests.model.test_walk import make

H, K, N = 6, 5, SMALL["history_len"]


def fed_histories(B: int, seed: int):
    """The same commits into the engine's VerifiedHistory (rows 0..B-1) and the ring (slots 3..)."""
    g = torch.Generator().manual_seed(seed)
    engine, ring = VerifiedHistory(B, N, F_DIM), RequestFeatureRing(B + 3, N, F_DIM)
    slots = torch.arange(3, 3 + B)
    for _ in range(4):
        feats, n_new = torch.randn(B, 5, F_DIM, generator=g), torch.randint(0, 6, (B,), generator=g)
        engine.push(feats, n_new)
        ring.append(slots, feats, n_new)
    return engine, ring, slots


@pytest.mark.parametrize("gate_bias", [0.0, 4.0])
def test_seam_returns_the_engine_path(gate_bias):
    sel = perturb(make(0, H=H, K=K), 1, gate_bias=gate_bias)
    for seed in range(3):
        B = 2 + seed
        engine, ring, slots = fed_histories(B, seed)
        block = random_block(B, seed)
        anchors = torch.randint(0, 50, (B,))
        ctx = SelectionContext(
            anchor_ids=anchors,
            anchor_pos=torch.zeros(B, dtype=torch.long),
            row_ids=torch.arange(B),
            history=engine.feats,
            history_mask=engine.mask(),
        )
        ref = sel.select(block, ctx)
        seam = DRelayCandidateSelector(sel, history=ring, max_bs=8)
        seam.stage_requests(slots)
        scores = seam.build_lattice(block.cand_ids, block.cand_logq, block.hidden, anchors)
        tokens, q = seam.sample_path(
            candidate_ids=block.cand_ids,
            scores=scores,
            uniforms=torch.rand(B, H),
            temperatures=torch.ones(B),
            greedy_mask=torch.ones(B, dtype=torch.bool),
        )
        assert torch.equal(tokens, ref.path_ids)
        assert torch.equal(q.argmax(-1), ref.pool_index) and torch.equal(q.sum(-1), torch.ones(B, H))


def test_seam_compiles_as_one_graph():
    torch._dynamo.reset()
    sel = perturb(make(2, H=H, K=K), 3, gate_bias=4.0)
    _, ring, slots = fed_histories(2, 0)
    seam = DRelayCandidateSelector(sel, history=ring, max_bs=4)
    seam.stage_requests(slots)
    block, anchors = random_block(2, 5), torch.tensor([4, 9])

    def step(ids, logq, hidden, anchor):
        return seam.sample_path(candidate_ids=ids, scores=seam.build_lattice(ids, logq, hidden, anchor))

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got, ref = (
        compiled(block.cand_ids, block.cand_logq, block.hidden, anchors),
        step(block.cand_ids, block.cand_logq, block.hidden, anchors),
    )
    assert torch.equal(got[0], ref[0])
    torch._dynamo.reset()


def test_seam_needs_a_ring_of_the_selector_history_length():
    sel = make(0, H=H, K=K)
    with pytest.raises(ValueError, match="RequestFeatureRing"):
        DRelayCandidateSelector(sel, history=RequestFeatureRing(2, N + 1, F_DIM), max_bs=2)


def test_exported_model_exposes_the_seam(tmp_path):
    from deploy.sglang.export import export_sglang
    from drelay_model.target import tiny_target
    from tests.deploy.test_sglang_export import trained_checkpoint

    target = tiny_target("tiny-qwen3", layers=4)
    drafter, selector = trained_checkpoint(target, tmp_path / "ckpt")
    model = DRelayDraftModel.from_pretrained(
        export_sglang(tmp_path / "ckpt", tmp_path / "out", dtype="float32", context_length=4096), target
    )
    seam = model.selector_seam(max_requests=4, max_bs=2)
    hidden = torch.randn(2 * drafter.config.num_slots, target.hidden_size)
    ids, logq = model.compute_candidates(hidden)
    block = drafter.pool(hidden.view(2, drafter.config.num_slots, -1))
    assert torch.equal(ids.view_as(block.cand_ids), block.cand_ids) and torch.equal(
        logq.view_as(block.cand_logq), block.cand_logq
    )
    seam.stage_requests(torch.tensor([1, 3]))
    scores = seam.build_lattice(block.cand_ids, block.cand_logq, block.hidden, torch.tensor([2, 5]))
    assert scores.shape == block.cand_ids.shape
