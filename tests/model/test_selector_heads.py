"""The pool heads `dcoco`, `dflash2`, `domino`, `dspark`: brute-force references for each scoring and
selection rule on tiny shapes, training ↔ inference consistency, and fresh heads = native."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")
import torch.nn.functional as F

from drelay_model.drafter import DraftBlock
from drelay_model.selectors import SelectionContext, SelectorTrainInputs, default_registry
from drelay_model.selectors.dcoco import DCOCOConfig, DCOCOSelector
from drelay_model.selectors.dflash2 import DFlash2Config, DFlash2Selector
from drelay_model.selectors.domino import DominoConfig, DominoSelector
from drelay_model.selectors.dspark import DSparkConfig, DSparkSelector, cut_length

B, H, K, D, V = 3, 5, 4, 8, 40
HEADS = ("dcoco", "dflash2", "domino", "dspark")


def _head(cls, config, seed=0):
    torch.manual_seed(seed)
    embed = torch.randn(V, D)
    head = cls(config, embed_weight=embed, hidden_size=D, num_slots=H, top_k=K)
    for p in head.parameters():  # leave the zero (native) initialisation: non-trivial scores
        torch.nn.init.normal_(p, std=0.5)
    return head.eval()


def _block(seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(B * H)]).view(B, H, K)
    logq = torch.randn(B, H, K, generator=g).sort(dim=-1, descending=True).values - 2.0
    return DraftBlock(hidden=torch.randn(B, H, D, generator=g), cand_ids=ids, cand_logq=logq)


def _ctx(anchor):
    return SelectionContext(anchor_ids=anchor, anchor_pos=torch.zeros(B, dtype=torch.long), row_ids=torch.arange(B))


ANCHOR = torch.tensor([3, 17, 29])


def _lin(layer, x):
    return F.linear(x, layer.weight, layer.bias)


def test_dcoco_parallel_scores_and_prefix_first_walk_match_a_brute_force_reference():
    sel, block = _head(DCOCOSelector, DCOCOConfig(d=6, mlp=5)), _block()
    E = sel.embed_weight

    def cand(b, p, k):  # c_pk, one candidate at a time
        x = _lin(sel.slot_in, block.hidden[b, p]) + _lin(sel.cand_in, E[block.cand_ids[b, p, k]])
        x = x + block.cand_logq[b, p, k].clamp(min=-30) * sel.logq_in
        return F.layer_norm(x, (x.shape[-1],), sel.norm.weight, sel.norm.bias)

    def score(b, p, a, k):  # S_p(a, k), one pair at a time
        ca, cb = cand(b, p, a), cand(b, p + 1, k)
        u = _lin(sel.pred, ca) + _lin(sel.succ, cb) + _lin(sel.pair, ca * cb) + _lin(sel.pair_state, block.hidden[b, p])
        return float(block.cand_logq[b, p + 1, k] + _lin(sel.out, F.gelu(u))[0])

    with torch.no_grad():
        got = sel.select(block, _ctx(ANCHOR)).pool_index
        for b in range(B):
            walk = [0]  # slot 0: the draft argmax
            for p in range(H - 1):
                row = [score(b, p, walk[-1], k) for k in range(K)]
                walk.append(max(range(K), key=lambda k: (row[k], -k)))
            assert got[b].tolist() == walk
            lattice = sel.transition_scores(block)
            assert lattice[b, 1, 2, 3].item() == pytest.approx(score(b, 1, 2, 3), abs=1e-5)


def test_dflash2_lattice_walk_with_the_anchor_as_slot_0_predecessor_matches_a_brute_force_reference():
    sel, block = _head(DFlash2Selector, DFlash2Config(rank=3)), _block()
    E, s = sel.embed_weight, 1 / math.sqrt(3)

    def edge(b, i, a_id, k):  # L_i(a, b): unary + codebook pair term
        h, v = block.hidden[b, i], block.cand_ids[b, i, k]
        psi = _lin(sel.succ_code, E[v])
        unary = block.cand_logq[b, i, k] + s * (_lin(sel.unary, h) @ psi)
        return float(unary + s * (_lin(sel.pred_code, E[a_id]) * _lin(sel.slot_gate, h) * psi).sum())

    with torch.no_grad():
        got = sel.select(block, _ctx(ANCHOR)).path_ids
        for b in range(B):
            prev, path = int(ANCHOR[b]), []
            for i in range(H):
                row = [edge(b, i, prev, k) for k in range(K)]
                k = max(range(K), key=lambda j: (row[j], -j))
                prev = int(block.cand_ids[b, i, k])
                path.append(prev)
            assert got[b].tolist() == path


def test_domino_applies_its_residual_slot_by_slot_on_the_chosen_prefix():
    sel, block = _head(DominoSelector, DominoConfig(d=6)), _block()
    with torch.no_grad():
        got = sel.select(block, _ctx(ANCHOR))
        for b in range(B):  # reference: one GRU step per slot, fed the token chosen before
            g, prev, picks = torch.zeros(1, 6), int(ANCHOR[b]), []
            for i in range(H):
                x = _lin(sel.token_in, sel.embed_weight[prev]) + _lin(sel.slot_in, block.hidden[b, i])
                g = sel.gru(x[None], g)
                post = block.cand_logq[b, i] + sel.embed_weight[block.cand_ids[b, i]] @ _lin(sel.out, g[0])
                k = int(post.argmax())
                picks.append(k)
                prev = int(block.cand_ids[b, i, k])
            assert got.pool_index[b].tolist() == picks
        # teacher forcing on the chosen prefix reproduces the served decisions (training = inference)
        prev = torch.cat([ANCHOR[:, None], got.path_ids[:, :-1]], dim=1)
        assert torch.equal(sel.post_scores(block, prev).argmax(-1), got.pool_index)
        # causal order: changing slot 3's pool leaves slots 0..2 unchanged
        ids = block.cand_ids.clone()
        ids[:, 3] = torch.randint(0, V, (B, K))
        other = sel.select(DraftBlock(block.hidden, ids, block.cand_logq), _ctx(ANCHOR))
        assert torch.equal(other.pool_index[:, :3], got.pool_index[:, :3])


def test_dspark_cut_rule_matches_a_brute_force_reference():
    g = torch.Generator().manual_seed(0)
    conf = torch.rand(200, H, generator=g) ** 0.3
    for threshold in (0.0, 0.1, 0.5, 0.9):
        for min_length in (1, 2, H + 3):
            got = cut_length(conf, threshold, min_length)
            for row, n in zip(conf.tolist(), got.tolist()):
                prod, ref = 1.0, 0
                for p in row:
                    prod *= p
                    if prod < threshold:
                        break
                    ref += 1
                assert n == min(max(ref, min_length), H)


def test_dspark_markov_walk_and_its_cut_match_a_brute_force_reference():
    sel, block = _head(DSparkSelector, DSparkConfig(rank=3, threshold=0.02, min_length=1)), _block()
    E, s = sel.embed_weight, 1 / math.sqrt(3)
    with torch.no_grad():
        got = sel.select(block, _ctx(ANCHOR))
        for b in range(B):
            prev, path, prod, n = int(ANCHOR[b]), [], 1.0, 0
            for i in range(H):
                row = block.cand_logq[b, i] + s * (_lin(sel.succ_code, E[block.cand_ids[b, i]]) @ _lin(sel.pred_code, E[prev]))
                k = int(row.argmax())
                prod *= float(row.softmax(-1)[k] * block.cand_logq[b, i].exp().sum())
                n += prod >= 0.02 and n == i
                prev = int(block.cand_ids[b, i, k])
                path.append(prev)
            assert got.path_ids[b].tolist() == path
            assert int(got.length[b]) == max(n, 1)


@pytest.mark.parametrize("name", HEADS)
def test_a_fresh_head_serves_the_native_path(target, make_drafter, prompts_of, name):
    drafter = make_drafter(target, top_k=8)
    sel = default_registry().create(name, drafter=drafter)
    block = drafter.pool(torch.randn(2, drafter.config.num_slots, drafter.config.hidden_size))
    ctx = SelectionContext(anchor_ids=torch.tensor([1, 2]), anchor_pos=torch.tensor([4, 5]), row_ids=torch.arange(2))
    assert torch.equal(sel.eval().select(block, ctx).pool_index, torch.zeros_like(block.cand_ids[..., 0]))


@pytest.mark.parametrize("name", ("dcoco", "dflash2", "dspark"))
def test_teacher_forced_training_scores_equal_the_served_scores_on_the_chosen_prefix(name):
    """Training scores slot i with the label prefix; on a label prefix equal to the chosen path, the
    argmax of the training scores is the served decision (slot 0 of dcoco is always native)."""
    cls, cfg = {"dcoco": (DCOCOSelector, DCOCOConfig(d=6, mlp=5)), "dflash2": (DFlash2Selector, DFlash2Config(rank=3)),
                "dspark": (DSparkSelector, DSparkConfig(rank=3, threshold=0.0))}[name]  # fmt: skip
    sel, block = _head(cls, cfg), _block()
    with torch.no_grad():
        served = sel.select(block, _ctx(ANCHOR))
        inputs = SelectorTrainInputs(labels=served.path_ids, valid=torch.ones(B, H, dtype=torch.bool)).with_block(block, ANCHOR)
        out = sel.training_loss(inputs)
    assert out.metrics["selector/acc"] == 1.0  # every teacher-forced argmax is the served choice
    assert math.isfinite(out.weighted_sum.item())


@pytest.mark.parametrize("name", HEADS)
def test_bad_head_configs_are_one_line_errors(make_drafter, target, name):
    from drelay_model.errors import DRelayError

    drafter = make_drafter(target, top_k=8)
    with pytest.raises(DRelayError, match=f"{name} selector config has unknown keys: nope"):
        default_registry().create(name, drafter=drafter, config={"nope": 1})
    bad = {"dcoco": {"d": 0}, "dflash2": {"rank": -1}, "domino": {"base_decay": 0.0}, "dspark": {"threshold": 1.0}}[name]
    with pytest.raises(DRelayError, match=f"invalid {name} selector config: bad value for {next(iter(bad))}"):
        default_registry().create(name, drafter=drafter, config=bad)
