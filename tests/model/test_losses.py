"""DRelay losses against brute-force references: Eq. 3, 4, 5, the credit normalisation, support CE."""

from __future__ import annotations

import math

import pytest
import torch

from drelay_model.training.losses import (
    LossSwitches,
    blend_weights,
    joint_loss,
    log_p_act,
    normalize_credit,
    prefix_credit,
    repair_weights,
    selector_loss,
    support_ce,
)


def _sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# ---- support CE ---------------------------------------------------------------------------------
def test_support_ce_full_vocabulary_matches_log_softmax():
    g = torch.Generator().manual_seed(0)
    B, H, V = 2, 3, 11
    logits = torch.randn(B, H, V, generator=g)
    labels = torch.randint(0, V, (B, H), generator=g)
    mask = torch.tensor([[True, False, True], [True, True, True]])
    out = support_ce(logits, labels, mask)
    for b in range(B):
        for i in range(H):
            ref = -torch.log_softmax(logits[b, i].double(), -1)[labels[b, i]].item() if mask[b, i] else 0.0
            assert out.nll[b, i].item() == pytest.approx(ref, abs=1e-5)
    assert out.counted.tolist() == mask.tolist() and int(out.out_of_vocab) == 0


def test_support_ce_draft_vocabulary_ignores_and_counts_outside_labels():
    draft_to_target = torch.tensor([1, 4, 5, 9])  # sorted, as build_draft_vocab returns it
    logits = torch.randn(1, 4, 4, generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([[5, 2, 9, 3]])  # 2 and 3 are not in the draft vocabulary
    mask = torch.tensor([[True, True, True, False]])
    out = support_ce(logits, labels, mask, draft_to_target=draft_to_target)
    assert out.counted.tolist() == [[True, False, True, False]]
    assert int(out.out_of_vocab) == 1  # label 3 is unsupervised, so only label 2 counts
    assert out.nll[0, 0].item() == pytest.approx(-torch.log_softmax(logits[0, 0], -1)[2].item(), abs=1e-6)
    assert out.nll[0, 2].item() == pytest.approx(-torch.log_softmax(logits[0, 2], -1)[3].item(), abs=1e-6)
    assert out.nll[0, 1].item() == 0.0 and out.nll[0, 3].item() == 0.0


# ---- Eq. 2 / Eq. 3 ------------------------------------------------------------------------------
def test_log_p_act_is_eq2_and_normalised():
    g = torch.Generator().manual_seed(2)
    gate, rank = torch.randn(2, 3, generator=g), torch.randn(2, 3, 5, generator=g)
    lp = log_p_act(gate, rank)
    for b in range(2):
        for i in range(3):
            gi = gate[b, i].item()
            alts = [math.exp(rank[b, i, k].item()) for k in range(1, 5)]
            assert math.exp(lp[b, i, 0].item()) == pytest.approx(_sig(-gi), rel=1e-5)
            for k in range(1, 5):
                assert math.exp(lp[b, i, k].item()) == pytest.approx(_sig(gi) * alts[k - 1] / sum(alts), rel=1e-5)
    torch.testing.assert_close(lp.exp().sum(-1), torch.ones(2, 3))


def test_selector_loss_cases_of_eq3():
    g = torch.Generator().manual_seed(3)
    B, H, K = 2, 4, 5
    cand = torch.stack([torch.randperm(50, generator=g)[:K] for _ in range(B * H)]).view(B, H, K)
    gate, rank = torch.randn(B, H, generator=g), torch.randn(B, H, K, generator=g)
    labels = torch.stack([cand[0, 0, 0], cand[0, 1, 3], torch.tensor(99), cand[0, 3, 1]])[None].repeat(B, 1)
    labels[1] = torch.tensor([cand[1, 0, 2], 99, cand[1, 2, 0], cand[1, 3, 4]])
    mask = torch.ones(B, H, dtype=torch.bool)
    mask[1, 3] = False
    out = selector_loss(gate, rank, cand, labels, mask)
    for b in range(B):
        for i in range(H):
            hits = [k for k in range(K) if cand[b, i, k] == labels[b, i]]
            gi = gate[b, i].item()
            alts = [math.exp(rank[b, i, k].item()) for k in range(1, K)]
            if not mask[b, i] or not hits:
                ref, c, k, p = 0.0, False, -1, 0.0
            elif hits[0] == 0:  # covered base-correct: BCE(g, 0)
                k = 0
                ref, c, p = -math.log(1 - _sig(gi)), True, 1 - _sig(gi)
            else:  # covered alternative: BCE(g, 1) − log r_k
                k = hits[0]
                r = alts[k - 1] / sum(alts)
                ref, c, p = -math.log(_sig(gi)) - math.log(r), True, _sig(gi) * r
            assert out.per_token[b, i].item() == pytest.approx(ref, rel=1e-5, abs=1e-6)
            assert bool(out.covered[b, i]) == c and int(out.index[b, i]) == k
            assert out.p_label[b, i].item() == pytest.approx(p, rel=1e-5, abs=1e-7)


# ---- Eq. 5 --------------------------------------------------------------------------------------
def _credit_loops(p: list[float], c: list[bool]) -> list[float]:
    H = len(p)
    pb = [float(c[j]) * (1 + p[j]) / 2 for j in range(H)]
    out = []
    for i in range(H):
        reach = 1.0
        for j in range(i):
            reach *= pb[j]
        cont = 1.0
        for t in range(i + 1, H):
            prod = 1.0
            for j in range(i + 1, t + 1):
                prod *= pb[j]
            cont += prod
        out.append(float(c[i]) * reach * cont)
    return out


def test_prefix_credit_matches_explicit_loops():
    g = torch.Generator().manual_seed(4)
    B, H = 6, 7
    p = torch.rand(B, H, generator=g)
    c = torch.rand(B, H, generator=g) > 0.25
    c[0] = True
    v = prefix_credit(p * c, c)
    for b in range(B):
        ref = _credit_loops((p[b] * c[b]).tolist(), c[b].tolist())
        assert v[b].tolist() == pytest.approx(ref, rel=1e-5, abs=1e-7)
    # All covered with p = 1: p̄ = 1, v_i = 1 + (H − 1 − i) (reach 1, every later slot continues).
    ones = prefix_credit(torch.ones(1, 4), torch.ones(1, 4, dtype=torch.bool))
    assert ones.tolist() == [[4.0, 3.0, 2.0, 1.0]]


def test_prefix_credit_is_stopgrad():
    p = torch.rand(2, 5, requires_grad=True)
    v = prefix_credit(p, torch.ones(2, 5, dtype=torch.bool))
    assert not v.requires_grad


# ---- normalisation ------------------------------------------------------------------------------
def _water_fill_bisection(w_hat: list[float], cap: float) -> list[float]:
    lo, hi = 1.0, 1e6
    for _ in range(200):
        a = (lo + hi) / 2
        if sum(min(cap, a * x) for x in w_hat) / len(w_hat) < 1.0:
            lo = a
        else:
            hi = a
    return [min(cap, hi * x) for x in w_hat]


@pytest.mark.parametrize("floor, cap", [(0.1, 4.0), (0.2, 2.0), (0.05, 1.5), (1.0, 4.0)])
def test_normalize_credit_mean_one_floor_cap(floor, cap):
    g = torch.Generator().manual_seed(5)
    B, H = 40, 15
    v = torch.rand(B, H, generator=g) ** 6 * 10  # skewed: caps bind often
    v[v < 0.01] = 0.0
    valid = torch.rand(B, H, generator=g) > 0.3
    valid[0] = False  # an empty block
    valid[1] = False
    valid[1, 4] = True  # a single valid position
    v[1, 4] = 0.5
    v[2] = 0.0  # a block with no credit: the floor alone
    w = normalize_credit(v, valid, floor=floor, cap=cap)
    assert (w[~valid] == 0).all() and (w[0] == 0).all()
    assert w[1, 4].item() == pytest.approx(1.0)
    assert w[2][valid[2]].tolist() == pytest.approx([floor] * int(valid[2].sum()))
    for b in range(3, B):
        vals = w[b][valid[b]]
        if len(vals) == 0 or v[b][valid[b]].sum() == 0:
            continue
        assert vals.mean().item() == pytest.approx(1.0, abs=1e-5)
        assert vals.max().item() <= cap + 1e-5
        assert vals.min().item() >= floor - 1e-6
        raw = v[b][valid[b]].double()
        n = len(raw)
        share = raw * n / raw.sum()
        w_hat = (floor + (1 - floor) * share).tolist()
        assert vals.tolist() == pytest.approx(_water_fill_bisection(w_hat, cap), abs=1e-4)


def test_normalize_credit_constructed_cases():
    valid = torch.ones(1, 3, dtype=torch.bool)
    # No cap binding: ŵ = f + (1 − f) n v / Σv.
    w = normalize_credit(torch.tensor([[10.0, 0.0, 0.0]]), valid, floor=0.1, cap=4.0)
    assert w[0].tolist() == pytest.approx([2.8, 0.1, 0.1], abs=1e-6)
    # Cap 2: the excess 0.8 goes back to the others in proportion (a = 5): [2, 0.5, 0.5].
    w = normalize_credit(torch.tensor([[10.0, 0.0, 0.0]]), valid, floor=0.1, cap=2.0)
    assert w[0].tolist() == pytest.approx([2.0, 0.5, 0.5], abs=1e-6)
    # Equal credit → uniform; no credit at all → the floor alone.
    assert normalize_credit(torch.full((1, 3), 0.7), valid)[0].tolist() == pytest.approx([1.0] * 3)
    assert normalize_credit(torch.zeros(1, 3), valid, floor=0.1)[0].tolist() == pytest.approx([0.1] * 3)
    with pytest.raises(ValueError):
        normalize_credit(torch.zeros(1, 3), valid, floor=0.0)
    with pytest.raises(ValueError):
        normalize_credit(torch.zeros(1, 3), valid, cap=0.5)


def test_block_whose_first_slot_misses_gets_the_floor():
    """A slot-1 pool miss: every later decision is unreachable (reach 0), so Eq. 5 gives the whole
    block zero credit; its covered positions keep the uniform floor, not weight one."""
    H, K, floor = 4, 3, 0.1
    cand = torch.arange(2 * H * K).view(2, H, K)
    gate, rank = torch.zeros(2, H), torch.zeros(2, H, K)
    labels = cand[..., 0].clone()  # every slot base-correct …
    labels[1, 0] = 999  # … except block 1's first slot: a pool miss
    labels[1, 2] = cand[1, 2, 2]  # a covered repair behind it
    mask = torch.ones(2, H, dtype=torch.bool)
    sel = selector_loss(gate, rank, cand, labels, mask)
    assert prefix_credit(sel.p_label, sel.covered)[1].tolist() == [0.0] * H
    w = repair_weights(sel, beta=1.0, floor=floor, cap=4.0)
    assert w[1].tolist() == pytest.approx([0.0, floor, floor, floor])
    assert w[0].mean().item() == pytest.approx(1.0)  # a credited block keeps mean one
    half = repair_weights(sel, beta=0.5, floor=floor, cap=4.0)  # blended: (1 − β) + β f
    assert half[1, 1:].tolist() == pytest.approx([0.5 + 0.5 * floor] * (H - 1))


def test_blend_weights_progressive():
    valid = torch.tensor([[True, True, False]])
    w = torch.tensor([[1.6, 0.4, 0.0]])
    assert blend_weights(w, valid, 0.0).tolist() == [[1.0, 1.0, 0.0]]
    assert blend_weights(w, valid, 1.0)[0].tolist() == pytest.approx([1.6, 0.4, 0.0])
    assert blend_weights(w, valid, 0.5)[0].tolist() == pytest.approx([1.3, 0.7, 0.0])


# ---- Eq. 4 --------------------------------------------------------------------------------------
def _setup(seed=6, B=3, H=5, K=4, V=20):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, H, V, generator=g, requires_grad=True)
    cand = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(B * H)]).view(B, H, K)
    gate = torch.randn(B, H, generator=g, requires_grad=True)
    rank = torch.randn(B, H, K, generator=g, requires_grad=True)
    pick = torch.randint(0, K + 1, (B, H), generator=g)  # K = a miss
    labels = torch.where(pick < K, cand.gather(2, pick.clamp(max=K - 1)[..., None])[..., 0], torch.full((B, H), V - 1))
    labels = torch.where((pick == K) & (cand == V - 1).any(-1), torch.full_like(labels, V - 2), labels)
    mask = torch.rand(B, H, generator=g) > 0.2
    return logits, cand, gate, rank, labels, mask


@pytest.mark.parametrize(
    "switches", [LossSwitches(), LossSwitches(support=False), LossSwitches(selector=False), LossSwitches(credit=False)]
)
def test_joint_loss_eq4_and_ablations(switches):
    logits, cand, gate, rank, labels, mask = _setup()
    sup = support_ce(logits, labels, mask)
    sel = selector_loss(gate, rank, cand, labels, mask)
    alpha, beta = 0.3, 0.6
    out = joint_loss(sup, sel, mask, alpha=alpha, beta=beta, switches=switches)
    w = repair_weights(sel, beta=beta, uniform=not switches.credit)
    B, H = mask.shape
    num_sup = num_sel = 0.0
    for b in range(B):
        for i in range(H):
            if mask[b, i]:
                num_sup += -torch.log_softmax(logits[b, i].detach(), -1)[labels[b, i]].item()
                num_sel += alpha * w[b, i].item() * sel.per_token[b, i].item()
    den = mask.sum().item()
    ref_sup = num_sup / den if switches.support else 0.0
    ref_sel = num_sel / den if switches.selector else 0.0
    assert out.support.item() == pytest.approx(ref_sup, rel=1e-5)
    assert out.selector.item() == pytest.approx(ref_sel, rel=1e-5, abs=1e-7)
    assert out.loss.item() == pytest.approx(ref_sup + ref_sel, rel=1e-5)
    assert out.tokens.item() == den
    if not switches.credit:
        assert out.weights.tolist() == sel.covered.float().tolist()
    assert not out.weights.requires_grad  # stopgrad through the credit


def test_joint_loss_gradients_reach_logits_gate_rank():
    logits, cand, gate, rank, labels, mask = _setup(seed=7)
    out = joint_loss(support_ce(logits, labels, mask), selector_loss(gate, rank, cand, labels, mask), mask, alpha=1.0, beta=1.0)
    out.loss.backward()
    for t in (logits, gate, rank):
        assert t.grad is not None and t.grad.abs().sum() > 0
