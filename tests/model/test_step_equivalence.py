"""The memory-lean joint step (chunked vocabulary head, copy-free history windows, micro-batches)
equals the dense step it replaced: losses and every gradient, on tiny Llama and Qwen3 targets.

`_reference_step` is the dense computation as it was (full [B, M, H, V] logits, `support_ce`, a
separate pool log-softmax, windows by expand + gather + mask multiply), kept here as the oracle."""

from __future__ import annotations

import pytest
import torch

from drelay_model.selectors import default_registry
from drelay_model.training import losses
from drelay_model.training.anchors import eligible_anchors, make_blocks, sample_uniform_anchors, scout_anchors
from drelay_model.training.schedules import slot_weights
from drelay_model.training.step import DraftTrainModule, StepConfig, history_windows, training_step, training_step_backward

SEL = {"d_sel": 32, "read_dim": 32, "compact_dim": 16, "history_len": 8}


def _reference_windows(features, anchors, n):
    B, N, F = features.shape
    pos = anchors[:, :, None] - n + torch.arange(n)
    mask = pos >= 0
    win = torch.gather(features[:, None].expand(B, anchors.shape[1], N, F), 2, pos.clamp(min=0)[..., None].expand(-1, -1, -1, F))
    return (win * mask[..., None]).reshape(-1, n, F), mask.reshape(-1, n)


def _reference_step(core: DraftTrainModule, ids, mask, feats, cfg: StepConfig, gen) -> torch.Tensor:
    drafter, selector = core.drafter, core.selector
    B, N = ids.shape
    H = drafter.config.num_slots
    n_native = int(round(cfg.anchors_per_seq * cfg.native_fraction))
    anchors, ok = sample_uniform_anchors(eligible_anchors(mask), cfg.anchors_per_seq - n_native, gen)
    if n_native:
        with torch.no_grad():
            ctx = drafter.context_kv(feats, torch.arange(N)[None].expand(B, N))
        nat, nat_ok = scout_anchors(drafter, ctx, ids, ids, mask, n_native, gen)
        anchors, ok = torch.cat([anchors, nat], 1), torch.cat([ok, nat_ok], 1)
    blocks = make_blocks(ids, mask, anchors, ok, H)
    labels, valid = blocks.labels.reshape(-1, H), blocks.valid.reshape(-1, H)
    hidden = drafter(torch.gather(ids, 1, anchors), anchors, feats)[:, :, 1:]
    Bm, M, _, D = hidden.shape
    logits = drafter.logits(hidden)  # [B, M, H, V]: the dense path
    block = drafter.pool(hidden.reshape(Bm * M, H, D))
    support = losses.support_ce(logits.flatten(0, 1), labels, valid, draft_to_target=drafter.draft_to_target)
    support = losses.SupportLoss(
        nll=support.nll * slot_weights(H, cfg.slot_decay), counted=support.counted, out_of_vocab=support.out_of_vocab
    )
    if selector is None:
        return support.nll.sum() / valid.sum().clamp(min=1)
    history, hmask = _reference_windows(feats, anchors, selector.capabilities.history_len)
    out = selector.forward_train(
        block, anchor_ids=torch.gather(ids, 1, anchors).reshape(-1), prefix_tokens=labels, history=history, history_mask=hmask
    )
    sel = losses.selector_loss(out.gate, out.rank, block.cand_ids, labels, valid)
    return losses.joint_loss(support, sel, valid, alpha=cfg.alpha, beta=cfg.beta, floor=cfg.credit_floor, cap=cfg.credit_cap).loss


def _setup(target, make_drafter, *, joint: bool, draft_vocab: bool):
    torch.manual_seed(0)
    kw = {"draft_vocab_size": 64} if draft_vocab else {}
    d2t = torch.randperm(target.vocab_size)[:64].sort().values if draft_vocab else None
    from drelay_model.drafter import BlockDrafter, DrafterConfig

    drafter = BlockDrafter(DrafterConfig.for_target(target, num_layers=1, top_k=8, **kw), target, d2t)
    selector = default_registry().create("drelay", drafter=drafter, config=SEL) if joint else None
    if selector is not None:  # leave the zero-initialised residual heads non-zero, so every path carries gradient
        with torch.no_grad():
            for p in selector.residual_heads():
                p.normal_(0, 0.1)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, target.vocab_size, (4, 40), generator=g)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 6:] = True
    mask[2, 30:] = False
    feats = target(ids, target.new_cache(4, 40), feature_layers=drafter.config.target_layer_ids).features
    return DraftTrainModule(drafter, selector).train(), ids, mask, feats


def _grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("joint", [False, True], ids=["drafter", "joint"])
@pytest.mark.parametrize("draft_vocab", [False, True], ids=["full-vocab", "draft-vocab"])
def test_chunked_micro_batched_step_equals_the_dense_step(target, make_drafter, joint, draft_vocab):
    module, ids, mask, feats = _setup(target, make_drafter, joint=joint, draft_vocab=draft_vocab)
    cfg = StepConfig(anchors_per_seq=6, native_fraction=0.5, alpha=0.7, beta=0.6)
    ref = _reference_step(module, ids, mask, feats, cfg, torch.Generator().manual_seed(5))
    ref.backward()
    ref_grads = _grads(module)
    assert len(ref_grads) > 5
    for micro, chunk in [(1, 10_000), (1, 40), (2, 16), (4, 7)]:
        module.zero_grad(set_to_none=True)
        c = StepConfig(**{**cfg.__dict__, "micro_batches": micro, "chunk_tokens": chunk})
        out = training_step_backward(module, module, ids, mask, feats, c, torch.Generator().manual_seed(5))
        torch.testing.assert_close(out.loss, ref.detach(), atol=1e-5, rtol=1e-5)
        grads = _grads(module)
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], atol=1e-5, rtol=1e-4, msg=f"{name} (micro={micro}, chunk={chunk})")
    module.zero_grad(set_to_none=True)
    single = training_step(module, module, ids, mask, feats, cfg, torch.Generator().manual_seed(5))
    torch.testing.assert_close(single.loss, ref.detach(), atol=1e-5, rtol=1e-5)


def test_history_windows_equal_the_masked_gather():
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(3, 20, 5, generator=g).to(torch.bfloat16)
    anchors = torch.randint(0, 20, (3, 7), generator=g)
    win, mask = history_windows(feats, anchors, 6)
    ref_win, ref_mask = _reference_windows(feats, anchors, 6)
    assert win.dtype == torch.bfloat16 and torch.equal(win, ref_win) and torch.equal(mask, ref_mask)
