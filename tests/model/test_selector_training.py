"""Selector-owned training: the joint step adds each trainable selector's own loss (α_t, Eq. 4)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")

from drelay_model.selectors import default_registry
from drelay_model.selectors.registry import trainable_selectors
from drelay_model.training import losses
from drelay_model.training.anchors import eligible_anchors, make_blocks, sample_uniform_anchors, scout_anchors
from drelay_model.training.schedules import slot_weights
from drelay_model.training.step import DraftTrainModule, StepConfig, history_windows, training_step


def _batch(target, n=4, length=30, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (n, length), generator=g)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 5:] = True
    return ids, mask


def _reference_drelay_loss(core, ids, mask, feats, cfg, gen):
    """The joint step as it was before selectors owned their loss (DRelay's Eq. 3/5 applied by the
    step through `losses.joint_loss`), kept here as the reference."""
    drafter, selector = core.drafter, core.selector
    B, N = ids.shape
    H = drafter.config.num_slots
    n_native = int(round(cfg.anchors_per_seq * cfg.native_fraction))
    anchors, ok = sample_uniform_anchors(eligible_anchors(mask), cfg.anchors_per_seq - n_native, gen)
    with torch.no_grad():
        ctx = drafter.context_kv(feats, torch.arange(N)[None].expand(B, N))
    nat, nat_ok = scout_anchors(drafter, ctx, ids, ids, mask, n_native, gen)
    anchors, ok = torch.cat([anchors, nat], 1), torch.cat([ok, nat_ok], 1)
    blocks = make_blocks(ids, mask, anchors, ok, H)
    labels, valid = blocks.labels.reshape(-1, H), blocks.valid.reshape(-1, H)
    history, hmask = history_windows(feats, anchors, selector.capabilities.history_len)
    anchor_ids = torch.gather(ids, 1, anchors)
    hidden = drafter(anchor_ids, anchors, feats)[:, :, 1:]
    Bb, M, _, D = hidden.shape
    logits = drafter.logits(hidden)
    block = drafter.pool(hidden.reshape(Bb * M, H, D))
    out = selector.forward_train(
        block, anchor_ids=anchor_ids.reshape(-1), prefix_tokens=labels, history=history, history_mask=hmask
    )
    support = losses.support_ce(logits.flatten(0, 1), labels, valid, draft_to_target=drafter.draft_to_target)
    support = losses.SupportLoss(
        nll=support.nll * slot_weights(H, cfg.slot_decay), counted=support.counted, out_of_vocab=support.out_of_vocab
    )
    sel = losses.selector_loss(out.gate, out.rank, block.cand_ids, labels, valid)
    return losses.joint_loss(
        support, sel, valid, alpha=cfg.alpha, beta=cfg.beta, floor=cfg.credit_floor, cap=cfg.credit_cap, switches=cfg.switches
    )


@pytest.mark.parametrize(
    "switches", [losses.LossSwitches(), losses.LossSwitches(credit=False), losses.LossSwitches(support=False)]
)
def test_drelay_loss_through_the_selector_interface_is_bit_identical(target, make_drafter, tiny_selector_config, switches):
    drafter = make_drafter(target, top_k=8)
    torch.manual_seed(1)
    selector = default_registry().create("drelay", drafter=drafter, config=tiny_selector_config("drelay"))
    for p in selector.residual_heads():  # leave the native initialisation: non-trivial gate and rank scores
        torch.nn.init.normal_(p, std=0.05)
    core = DraftTrainModule(drafter, selector).train()
    ids, mask = _batch(target)
    feats = target(ids, target.new_cache(4, ids.shape[1]), feature_layers=drafter.config.target_layer_ids).features
    cfg = StepConfig(anchors_per_seq=6, native_fraction=0.5, alpha=0.37, beta=0.6, switches=switches, scout_restart=False)
    new = training_step(core, core, ids, mask, feats, cfg, torch.Generator().manual_seed(3))
    grads_new = torch.autograd.grad(new.loss, [p for p in core.parameters() if p.requires_grad], allow_unused=True)
    ref = _reference_drelay_loss(core, ids, mask, feats, cfg, torch.Generator().manual_seed(3))
    grads_ref = torch.autograd.grad(ref.loss, [p for p in core.parameters() if p.requires_grad], allow_unused=True)
    assert torch.equal(new.loss, ref.loss)
    assert new.metrics["loss/selector"] == ref.selector.item() and new.metrics["loss/support"] == ref.support.item()
    assert new.metrics["pool/coverage"] == ref.coverage.item()
    # Same loss bit for bit; the gradients go through the chunked vocabulary head (summation order
    # differs from the dense reference's), so they agree to float rounding.
    for a, b in zip(grads_new, grads_ref):
        assert (a is None and b is None) or torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_trainable_selectors_are_listed_by_capability():
    names = trainable_selectors()
    reg = default_registry()
    assert "drelay" in names and "native" not in names
    assert all(reg.factory(n).capabilities.trainable for n in names)


def test_an_untrainable_selector_has_no_training_loss(target, make_drafter):
    from drelay_model.errors import DRelayError

    with pytest.raises(DRelayError, match="not trainable"):
        default_registry().create("native").training_loss(None)
