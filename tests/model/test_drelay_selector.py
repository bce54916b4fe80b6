"""The `drelay` selector: Eq. 1/2/6 behaviour, strict causality, training/inference agreement, and
lossless decoding through the engine (real and replayed)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from drelay_model.decoding import GenerationConfig, SpeculativeEngine, replay
from drelay_model.drafter import DraftBlock
from drelay_model.errors import DRelayError
from drelay_model.training.losses import joint_loss, selector_loss, support_ce
from drelay_model.selectors import SelectionContext, default_registry
from drelay_model.selectors.drelay import DRelayConfig, DRelaySelector, decide, null_attention

SMALL = {"d_sel": 32, "heads": 4, "read_dim": 16, "history_len": 8, "compact_dim": 16, "ffn_mult": 2}
V, D, F_DIM, H, K = 97, 24, 48, 6, 5


def make_selector(seed: int = 0, **overrides) -> DRelaySelector:
    torch.manual_seed(seed)
    embed = torch.randn(V, D)
    return DRelaySelector(
        DRelayConfig(**{**SMALL, **overrides}), embed_weight=embed, num_slots=H, top_k=K, feature_dim=F_DIM
    ).eval()


def perturb(sel: DRelaySelector, seed: int, *, scale: float = 1.0, gate_bias: float = 0.0) -> DRelaySelector:
    """Non-zero residual heads (a stand-in for a trained selector), optionally biased towards REPAIR."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in sel.residual_heads():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
        sel.causal.head.bias[1] += gate_bias
    return sel


def random_block(B: int, seed: int, *, ties: bool = False, requires_grad: bool = False) -> DraftBlock:
    g = torch.Generator().manual_seed(seed)
    logq = torch.log_softmax(torch.randn(B, H, V, generator=g) * 2.5, dim=-1)
    cand_logq, cand_ids = logq.topk(K, dim=-1)
    if ties:  # the best alternative exactly as likely as the native candidate
        cand_logq[..., 1] = cand_logq[..., 0]
    hidden = torch.randn(B, H, D, generator=g)
    if requires_grad:
        hidden.requires_grad_(True)
        cand_logq.requires_grad_(True)
    return DraftBlock(hidden=hidden, cand_ids=cand_ids, cand_logq=cand_logq)


def context(B: int, seed: int, *, masked: int = 2) -> SelectionContext:
    g = torch.Generator().manual_seed(seed + 100)
    mask = torch.ones(B, SMALL["history_len"], dtype=torch.bool)
    mask[:, :masked] = False
    return SelectionContext(
        anchor_ids=torch.randint(0, V, (B,), generator=g),
        anchor_pos=torch.zeros(B, dtype=torch.long),
        row_ids=torch.arange(B),
        history=torch.randn(B, SMALL["history_len"], F_DIM, generator=g),
        history_mask=mask,
    )


def train_out(sel, block, ctx, prefix):
    return sel.forward_train(
        block, anchor_ids=ctx.anchor_ids, prefix_tokens=prefix, history=ctx.history, history_mask=ctx.history_mask
    )


# ---- config and build ---------------------------------------------------------------------------
def test_config_is_validated_and_json_roundtrips():
    cfg = DRelayConfig(d_sel=64, global_read=False)
    assert DRelayConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert DRelayConfig().d_sel == 256 and DRelayConfig().heads == 4 and DRelayConfig().history_len == 64
    for bad in ({"d_sel": 30, "heads": 4}, {"read_dim": 6}, {"history_len": -1}, {"global_blocks": -1}, {"global_read": "yes"}):
        with pytest.raises(DRelayError, match="invalid drelay selector config"):
            DRelayConfig.from_dict(bad)
    with pytest.raises(DRelayError, match="unknown keys: nope"):
        DRelayConfig.from_dict({"nope": 1})


def test_build_from_drafter_shares_the_frozen_embedding(target, make_drafter):
    drafter = make_drafter(target)
    sel = default_registry().create("drelay", drafter=drafter, config=SMALL)
    assert sel.embed_weight.data_ptr() == drafter.embed_weight.data_ptr() and not sel.embed_weight.requires_grad
    assert "embed_weight" not in sel.state_dict()
    caps = sel.capabilities
    assert caps.trainable and caps.needs_hidden and caps.supports_sampling and caps.history_len == SMALL["history_len"]
    assert (sel.num_slots, sel.top_k) == (drafter.config.num_slots, drafter.config.top_k)
    with pytest.raises(DRelayError, match="needs a drafter"):
        default_registry().create("drelay")
    # Checkpoint convention: selector.<param> tensors + meta["selector"] = {name, config}.
    perturb(sel, 1)
    tensors = {f"selector.{k}": v for k, v in sel.state_dict().items()}
    meta = {"selector": {"name": "drelay", "config": sel.config.to_dict()}}
    loaded = default_registry().from_checkpoint("drelay", drafter=drafter, tensors=tensors, meta=meta)
    for k, v in sel.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v)


# ---- Eq. 6 / Eq. 2 at initialisation ------------------------------------------------------------
def test_fresh_selector_gate_is_native_log_odds_and_p_act_is_native():
    sel, block, ctx = make_selector(), random_block(3, 1), context(3, 1)
    prefix = torch.randint(0, V, (3, H))
    out = train_out(sel, block, ctx, prefix)
    lq = block.cand_logq
    torch.testing.assert_close(out.gate, lq[..., 1:].logsumexp(-1) - lq[..., 0], atol=0, rtol=0)  # Eq. 6, Δg = 0
    torch.testing.assert_close(out.rank, lq, atol=0, rtol=0)
    torch.testing.assert_close(out.log_p_act().exp(), torch.softmax(lq, dim=-1), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("global_read", [True, False])
def test_fresh_selector_picks_exactly_the_native_path(ties, global_read):
    sel = make_selector(global_read=global_read)
    for seed in range(5):
        block, ctx = random_block(4, seed, ties=ties), context(4, seed)
        sel_out = sel.select(block, ctx)
        assert sel_out.pool_index.eq(0).all()
        assert torch.equal(sel_out.path_ids, block.cand_ids[..., 0])
        ev, cand_emb = sel.evidence(block, ctx.history, ctx.history_mask)
        assert sel.causal.sequential(ev, sel.embed(ctx.anchor_ids), cand_emb)[0].eq(0).all()


def _decide_reference(g: float, s: list[float]) -> int:
    alts = s[1:]
    z = sum(math.exp(x) for x in alts)
    k_star = max(range(len(alts)), key=lambda k: (alts[k], -k))
    return k_star + 1 if g + math.log(math.exp(alts[k_star]) / z) > 1e-4 else 0


def test_decision_rule_constructed_cases_and_ties_keep():
    ninf = float("-inf")
    # Two equally good alternatives (r* = 1/2) and g = log 2: g + log r* = 0 exactly → a tie → KEEP.
    assert decide(torch.tensor(math.log(2.0)), torch.tensor([5.0, 0.0, 0.0, ninf])).item() == 0
    assert decide(torch.tensor(math.log(2.0) + 1e-2), torch.tensor([5.0, 0.0, 0.0, ninf])).item() == 1
    # A positive edit tendency alone is not enough when the alternatives are ambiguous (r* = 1/4).
    assert decide(torch.tensor(0.5), torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0])).item() == 0
    # A confident gate and a dominant alternative → REPAIR with k* = argmax_{k>0}.
    assert decide(torch.tensor(3.0), torch.tensor([9.0, -1.0, 4.0, 0.0])).item() == 2
    assert decide(torch.tensor(-3.0), torch.tensor([0.0, -1.0, 40.0, 0.0])).item() == 0  # r* ≈ 1, g < 0
    g = torch.Generator().manual_seed(0)
    gate, rank = torch.randn(500, generator=g) * 3, torch.randn(500, 6, generator=g) * 2
    got = decide(gate, rank).tolist()
    assert got == [_decide_reference(gate[n].item(), rank[n].tolist()) for n in range(500)]
    assert 0 < sum(x > 0 for x in got) < 500


# ---- causality and training/inference agreement -------------------------------------------------
def test_decision_i_depends_only_on_tokens_chosen_before_i():
    sel = perturb(make_selector(), 2)
    block, ctx = random_block(2, 3), context(2, 3)
    g = torch.Generator().manual_seed(4)
    prefix = torch.randint(0, V, (2, H), generator=g)
    base = train_out(sel, block, ctx, prefix)
    for j in range(H):
        changed = prefix.clone()
        changed[:, j] = (changed[:, j] + 1 + torch.randint(0, V - 1, (2,), generator=g)) % V
        out = train_out(sel, block, ctx, changed)
        # Decisions at i ≤ j (the token at j is not before them) never change ...
        assert torch.equal(out.gate[:, : j + 1], base.gate[:, : j + 1])
        assert torch.equal(out.rank[:, : j + 1], base.rank[:, : j + 1])
        if j + 1 < H:  # ... the decision right after j can.
            assert not torch.allclose(out.rank[:, j + 1], base.rank[:, j + 1])
            assert not torch.allclose(out.gate[:, j + 1], base.gate[:, j + 1])


@pytest.mark.parametrize("gate_bias", [0.0, 2.0, 6.0])
def test_select_equals_teacher_forcing_on_its_own_path(gate_bias):
    sel = perturb(make_selector(), 5, gate_bias=gate_bias)
    repairs = 0
    for seed in range(4):
        block, ctx = random_block(3, seed), context(3, seed)
        trace = sel.select_with_scores(block, ctx)
        out = train_out(sel, block, ctx, trace.selection.path_ids)
        torch.testing.assert_close(out.gate, trace.output.gate, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.rank, trace.output.rank, atol=1e-5, rtol=1e-5)
        assert torch.equal(out.decisions(), trace.selection.pool_index)
        # The literal slot-by-slot loop and the parallel passes make the same decisions.
        ev, cand_emb = sel.evidence(block, ctx.history, ctx.history_mask)
        anchor = sel.embed(ctx.anchor_ids)
        seq_pick, seq_gate, seq_rank = sel.causal.sequential(ev, anchor, cand_emb)
        assert torch.equal(seq_pick, trace.selection.pool_index)
        torch.testing.assert_close(seq_gate, trace.output.gate, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(seq_rank, trace.output.rank, atol=1e-5, rtol=1e-5)
        assert torch.equal(sel.causal.decide_block(ev, anchor, cand_emb, max_passes=1)[0], seq_pick)  # fallback
        repairs += int((seq_pick != 0).sum())
    if gate_bias > 0:
        assert repairs > 0


# ---- null key -----------------------------------------------------------------------------------
def test_null_key_gives_a_zero_read_when_all_evidence_is_masked():
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g) for _ in range(3))
    mask = torch.tensor([[False] * 5, [True, False, True, False, False]])
    bias = torch.randn(2, 4, 5, 5, generator=g)
    out = null_attention(q, k, v, bias=bias, key_mask=mask)
    assert torch.equal(out[0], torch.zeros_like(out[0]))  # only the null key is left: a zero read
    # Brute force for row 1: joint normalisation over {null (logit 0, value 0), keys 0 and 2}.
    logits = (q[1] @ k[1].transpose(-1, -2) / math.sqrt(8) + bias[1].transpose(-1, -2))[..., [0, 2]]  # [nh, Q, 2]
    e = logits.exp()
    ref = (e[..., None] * v[1][:, None, [0, 2]]).sum(-2) / (1 + e.sum(-1, keepdim=True))
    torch.testing.assert_close(out[1], ref, atol=1e-5, rtol=1e-5)
    # Candidate reads (Eq. 1) with every candidate masked are content-free: exactly zero.
    sel = make_selector()
    gr = sel.global_read
    n = torch.randn(2, H, K, SMALL["d_sel"], generator=g)
    read = gr.candidate_read(n, torch.randn(2, H, K, generator=g), torch.zeros(2, H, K, dtype=torch.bool))
    assert torch.equal(read, torch.zeros_like(read))


def test_candidate_read_is_eq1():
    """G_ik = W_O Σ_{j,l} A_ik,jl W_V n_jl with A ∝ exp(q·k/√d_g + log q_j(v_jl) + b_{j−i}) and a null key."""
    sel = make_selector()
    gr = sel.global_read
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():
        gr.rel_bias.copy_(torch.randn(gr.rel_bias.shape, generator=g))
    n, logq = torch.randn(1, H, K, SMALL["d_sel"], generator=g), torch.randn(1, H, K, generator=g) - 2
    got = gr.candidate_read(n, logq, None)[0]  # [H, K, d]
    r, nh = SMALL["read_dim"], SMALL["heads"]
    dg = r // nh
    Wq, Wk, Wv = gr.read_qkv.weight.detach().split(r, dim=0)  # [r, d] each, heads contiguous
    keys = n[0].reshape(H * K, -1)
    slot_of = torch.arange(H).repeat_interleave(K)
    heads = torch.zeros(H, K, r)
    for i in range(H):
        for k in range(K):
            for h in range(nh):
                sl = slice(h * dg, (h + 1) * dg)
                logits = (keys @ Wk[sl].T) @ (Wq[sl] @ n[0, i, k]) / math.sqrt(dg)
                logits = logits + logq[0].reshape(-1) + gr.rel_bias[h, slot_of - i + H - 1].detach()
                w = logits.exp() / (1 + logits.exp().sum())  # the null key adds exp(0) = 1
                heads[i, k, sl] = w @ (keys @ Wv[sl].T)
    torch.testing.assert_close(got, heads @ gr.read_out.weight.detach().T, atol=1e-5, rtol=1e-4)


def test_fully_masked_history_equals_no_history():
    sel = perturb(make_selector(), 7)
    block, ctx = random_block(2, 8), context(2, 8, masked=SMALL["history_len"])
    ev_masked, _ = sel.evidence(block, ctx.history, ctx.history_mask)
    ev_none, _ = sel.evidence(block, None, None)
    torch.testing.assert_close(ev_masked.pre, ev_none.pre, atol=1e-6, rtol=1e-6)
    ev_real, _ = sel.evidence(block, ctx.history, torch.ones_like(ctx.history_mask))
    assert not torch.allclose(ev_real.pre, ev_none.pre)


# ---- gradients ----------------------------------------------------------------------------------
def test_gradients_reach_the_selector_and_drafter_outputs_not_the_frozen_embedding():
    sel = perturb(make_selector(), 9).train()
    embed_before = sel.embed_weight.clone()
    block, ctx = random_block(3, 9, requires_grad=True), context(3, 9)
    labels = torch.where(torch.rand(3, H) < 0.6, block.cand_ids[..., 1], block.cand_ids[..., 0])
    out = train_out(sel, block, ctx, labels)
    mask = torch.ones(3, H, dtype=torch.bool)
    logits = torch.randn(3, H, V, requires_grad=True)
    loss = joint_loss(
        support_ce(logits, labels, mask),
        selector_loss(out.gate, out.rank, block.cand_ids, labels, mask),
        mask,
        alpha=1.0,
        beta=1.0,
    )
    loss.loss.backward()
    no_grad = [n for n, p in sel.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert no_grad == []
    assert sel.embed_weight.grad is None and not sel.embed_weight.requires_grad
    assert torch.equal(sel.embed_weight, embed_before)
    assert block.hidden.grad.abs().sum() > 0 and block.cand_logq.grad.abs().sum() > 0


def test_fresh_selector_trains_its_zero_initialised_heads_first():
    sel = make_selector().train()
    block, ctx = random_block(2, 10), context(2, 10)
    out = train_out(sel, block, ctx, block.cand_ids[..., 1])
    (out.gate.sum() + out.rank.logsumexp(-1).sum()).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in sel.causal.head.parameters())


# ---- through the engine -------------------------------------------------------------------------


class Recording(DRelaySelector):
    """Test-only: records every decision by (request, anchor position)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: dict[tuple[int, int], list[int]] = {}

    def select(self, block, ctx):
        sel = super().select(block, ctx)
        for i, key in enumerate(zip(ctx.row_ids.tolist(), ctx.anchor_pos.tolist())):
            self.seen[key] = sel.pool_index[i].tolist()
        return sel

    @property
    def repairs(self) -> int:
        return sum(k != 0 for picks in self.seen.values() for k in picks)


def engine_selector(drafter, *, perturbed: bool) -> Recording:
    torch.manual_seed(0)
    sel = Recording.build(drafter=drafter, config=SMALL)
    return perturb(sel, 11, gate_bias=4.0) if perturbed else sel


@pytest.mark.parametrize("perturbed", [False, True], ids=["fresh", "perturbed"])
def test_greedy_decoding_with_drelay_is_lossless(hf_greedy, target, make_drafter, prompts_of, perturbed):
    prompts = prompts_of(target.vocab_size, (5, 9, 3, 12))
    drafter = make_drafter(target)
    selector = engine_selector(drafter, perturbed=perturbed)
    result = SpeculativeEngine(target, drafter, selector).generate(prompts, GenerationConfig(max_new_tokens=30))
    for b, p in enumerate(prompts):
        assert result.tokens[b] == hf_greedy(target, p, 30), f"row {b} differs from HF generate"
    assert (selector.repairs > 0) == perturbed


def test_replay_tau_equals_real_tau_with_drelay(target, make_drafter, prompts_of):
    prompts = prompts_of(target.vocab_size, (5, 9, 3, 12))
    drafter = make_drafter(target, top_k=16)
    live, offline = engine_selector(drafter, perturbed=True), engine_selector(drafter, perturbed=True)
    real = SpeculativeEngine(target, drafter, live).generate(prompts, GenerationConfig(max_new_tokens=30))
    replayed = replay(target, drafter, prompts, real.tokens, selector=offline)
    assert live.repairs > 0
    # Same verified history and pools → the same decision in every round, hence the same τ.
    assert live.seen == offline.seen
    assert replayed.rounds == real.stats.rounds
    assert replayed.committed == real.stats.committed
    assert replayed.tau == pytest.approx(real.stats.tau, abs=0)
    assert replayed.accept_hist.tolist() == real.stats.accept_hist.tolist()


# ---- the scout that follows the selector (DRelay §5) ----------------------------------------------
@pytest.mark.parametrize("gate_bias", [0.0, 4.0])
def test_selector_scout_accepts_what_incremental_selection_accepts(gate_bias):
    """Teacher-forced choices under the teacher prefix accept exactly as many drafts as incremental
    selection does, whatever the teacher tokens after the first failure."""
    from drelay_model.training.step import _selector_policy, history_windows

    sel = perturb(make_selector(), 9, gate_bias=gate_bias)
    B, N = 4, 30
    g = torch.Generator().manual_seed(3)
    features = torch.randn(B, N, F_DIM, generator=g)
    anchor_pos = torch.tensor([3, 12, 20, 29])
    anchor_ids = torch.randint(0, V, (B,), generator=g)
    policy = _selector_policy(sel, features)
    for seed in range(4):
        block = random_block(B, seed)
        hist, hmask = history_windows(features, anchor_pos[:, None], SMALL["history_len"])
        ctx = SelectionContext(
            anchor_ids=anchor_ids, anchor_pos=anchor_pos, row_ids=torch.arange(B), history=hist, history_mask=hmask
        )
        path = sel.select(block, ctx).path_ids  # [B, H] incremental selection
        labels = path.clone()
        first_error = torch.randint(0, H + 1, (B,), generator=g)  # H: no error at all
        for b in range(B):
            if first_error[b] < H:
                labels[b, first_error[b]] = (labels[b, first_error[b]] + 1) % V
                labels[b, first_error[b] + 1 :] = torch.randint(0, V, (H - 1 - int(first_error[b]),), generator=g)
        forced = policy(block, anchor_ids, anchor_pos, labels)
        accepted = lambda p: (p == labels).long().cumprod(1).sum(1)  # noqa: E731
        assert torch.equal(accepted(forced), accepted(path)) and torch.equal(accepted(path), first_error)


def test_fused_null_attention_equals_the_reference():
    """The inference path (SDPA with a zero null key row and a query-major bias) computes the same
    joint normalisation as `null_attention`, including exactly-zero reads where every key is masked;
    Global Read's candidate read agrees with and without autograd."""
    from drelay_model.selectors.drelay.global_read import fused_null_attention

    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 4, 7, 8, generator=g) for _ in range(3))
    k = k[:, :, :5]
    v = v[:, :, :5]
    bias = torch.randn(2, 4, 5, 7, generator=g)  # key-major for the reference
    mask = torch.tensor([[False] * 5, [True, False, True, True, False]])
    for b, m in ((None, None), (bias, None), (bias, mask), (None, mask)):
        ref = null_attention(q, k, v, bias=b, key_mask=m)
        got = fused_null_attention(q, k, v, bias=None if b is None else b.transpose(-1, -2), key_mask=m)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(fused_null_attention(q, k, v, key_mask=mask)[0], torch.zeros_like(q[0]))
    from drelay_model.selectors.drelay.global_read import GlobalRead

    H, K, nh, dg = 3, 4, 2, 8
    gr = GlobalRead(DRelayConfig(d_sel=16, heads=nh, read_dim=nh * dg), num_slots=H, top_k=K)
    with torch.no_grad():
        gr.rel_bias.copy_(torch.randn(nh, 2 * H - 1, generator=g))
    q, k, v = (torch.randn(2, nh, H * K, dg, generator=g) for _ in range(3))
    logq = torch.log_softmax(torch.randn(2, H, K, generator=g), dim=-1)
    key_mask = torch.rand(2, H, K, generator=g) > 0.3
    for m in (None, key_mask):
        train = gr.attend(q, k, v, logq, m)  # autograd on: the reference path
        with torch.no_grad():
            infer = gr.attend(q, k, v, logq, m)
        torch.testing.assert_close(infer, train.detach(), atol=1e-5, rtol=1e-5)
