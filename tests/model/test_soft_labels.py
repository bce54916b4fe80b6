"""Soft support labels: the target's renormalised top-k as the support term's target distribution."""

from __future__ import annotations

import math

import pytest
import torch

from drelay_model.drafter import BlockDrafter, DrafterConfig
from drelay_model.training.head import chunked_head
from drelay_model.training.losses import SoftLabels, soft_support_ce, soft_support_targets, support_ce
from drelay_model.training.step import DraftTrainModule, StepConfig, block_soft_labels, training_step_backward


def _random_case(B=3, H=4, V=40, k=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, H, V, generator=g)
    logp, ids = torch.randn(B, H, V, generator=g).mul(2).log_softmax(-1).topk(k, dim=-1)
    mask = torch.rand(B, H, generator=g) > 0.25
    return logits, SoftLabels(ids=ids, logp=logp), mask


def test_top1_soft_labels_are_the_hard_label_cross_entropy():
    logits, soft, mask = _random_case(k=1)
    hard = support_ce(logits, soft.ids[..., 0].contiguous(), mask)
    out = soft_support_ce(logits, soft, mask)
    torch.testing.assert_close(out.nll * out.counted, hard.nll * hard.counted)
    assert torch.equal(out.counted, hard.counted)


def test_one_hot_target_is_the_hard_label_cross_entropy():
    logits, soft, mask = _random_case(k=6)
    one_hot = SoftLabels(ids=soft.ids, logp=torch.full_like(soft.logp, float("-inf")).index_fill(-1, torch.tensor([0]), 0.0))
    d2t = torch.arange(0, 40, 2)  # a draft vocabulary of the even ids
    hard = support_ce(logits[..., ::2], soft.ids[..., 0].contiguous(), mask, draft_to_target=d2t)
    out = soft_support_ce(logits[..., ::2], one_hot, mask, draft_to_target=d2t)
    torch.testing.assert_close(out.nll * out.counted, hard.nll * hard.counted)
    assert torch.equal(out.counted, hard.counted) and out.out_of_vocab == hard.out_of_vocab


def test_ids_outside_the_draft_vocabulary_are_dropped_and_the_rest_renormalised():
    ids = torch.tensor([[[4, 3, 8, 1]]])  # the target's top 4 at one slot
    logp = torch.tensor([[[math.log(0.4), math.log(0.3), math.log(0.2), math.log(0.05)]]])
    d2t = torch.tensor([0, 1, 2, 4, 6, 8])  # 3 has no drafter row
    tgt = soft_support_targets(SoftLabels(ids, logp), torch.ones(1, 1, dtype=torch.bool), draft_to_target=d2t)
    kept = torch.tensor([0.4, 0.0, 0.2, 0.05]) / 0.65
    torch.testing.assert_close(tgt.weight[0, 0], kept)
    assert tgt.ids[0, 0].tolist() == [3, 0, 5, 1] and bool(tgt.counted[0, 0])  # draft ids of 4, (none), 8, 1
    logits = torch.randn(1, 1, 6)
    expected = -(kept * logits.log_softmax(-1)[0, 0][tgt.ids[0, 0]]).sum()
    torch.testing.assert_close(
        soft_support_ce(logits, SoftLabels(ids, logp), torch.ones(1, 1, dtype=torch.bool), draft_to_target=d2t).nll[0, 0],
        expected,
    )
    # nothing draftable: not counted, but reported; unsupervised slots neither
    none = soft_support_targets(
        SoftLabels(torch.tensor([[[3, 5]]]), logp[..., :2]), torch.ones(1, 1, dtype=torch.bool), draft_to_target=d2t
    )
    assert not none.counted.any() and none.out_of_vocab == 1 and none.weight.abs().sum() == 0


def _drafter(target, vocab: int | None) -> BlockDrafter:
    """An untrained 1-layer drafter; with `vocab`, a random draft vocabulary of that many ids."""
    torch.manual_seed(0)
    d2t = torch.randperm(target.vocab_size)[:vocab].sort().values if vocab else None
    cfg = DrafterConfig.for_target(target, num_layers=1, top_k=4, draft_vocab_size=vocab)
    return BlockDrafter(cfg, target, d2t)


def test_chunked_head_matches_the_dense_soft_loss_and_its_gradients(target):
    drafter = _drafter(target, 64)
    torch.manual_seed(0)
    R, H = 10, drafter.config.num_slots
    hidden = torch.randn(R, H, drafter.config.hidden_size, requires_grad=True)
    logp, ids = torch.randn(R, H, target.vocab_size).log_softmax(-1).topk(8, dim=-1)
    soft, mask = SoftLabels(ids=ids, logp=logp), torch.rand(R, H) > 0.2
    head = chunked_head(drafter, hidden, soft.ids[..., 0], mask, chunk_tokens=3 * H, soft=soft)
    dense = soft_support_ce(drafter.logits(hidden), soft, mask, draft_to_target=drafter.draft_to_target)
    torch.testing.assert_close(head.nll, dense.nll * dense.counted)
    assert torch.equal(head.counted, dense.counted) and head.out_of_vocab == dense.out_of_vocab
    (g_chunk,) = torch.autograd.grad(head.nll.sum(), hidden)
    (g_dense,) = torch.autograd.grad((dense.nll * dense.counted).sum(), hidden)
    torch.testing.assert_close(g_chunk, g_dense)
    assert g_chunk.abs().sum() > 0


def test_block_soft_labels_read_the_positions_after_each_anchor():
    B, N, k = 2, 12, 3
    ids = torch.arange(B * N * k).view(B, N, k)
    soft = SoftLabels(ids=ids, logp=ids.float())
    out = block_soft_labels(soft, torch.tensor([[2, 9], [0, 5]]), H=4)
    assert out.ids.shape == (B, 2, 4, k)
    assert torch.equal(out.ids[0, 0], ids[0, 3:7]) and torch.equal(out.ids[1, 1], ids[1, 6:10])
    assert torch.equal(out.ids[0, 1, :2], ids[0, 10:12]) and torch.equal(out.ids[0, 1, 2], ids[0, 11])  # clamped


def _tiny_batch(target, drafter):
    from drelay_model.decoding import GenerationConfig, SpeculativeEngine
    from pipelines.train.features import target_outputs

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, target.vocab_size, (6,), generator=g).tolist() for _ in range(3)]
    outs = SpeculativeEngine(target).generate(prompts, GenerationConfig(max_new_tokens=30)).tokens
    ids = torch.tensor([p + o for p, o in zip(prompts, outs)])
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 6:] = True
    got = target_outputs(target, ids, mask, drafter.config.target_layer_ids, top_k=8)
    return ids, mask, got


@pytest.mark.parametrize("vocab", [None, 128])
def test_a_real_training_step_on_the_tiny_target(target, vocab):
    """k = 1 soft labels give the hard-label step exactly (labels = the forward's argmax); k = 8 trains."""
    drafter = _drafter(target, vocab).train()
    module = DraftTrainModule(drafter)
    ids, mask, got = _tiny_batch(target, drafter)
    argmax = torch.where(mask, got.soft.ids[..., 0], ids)
    cfg = StepConfig(anchors_per_seq=8, native_fraction=0.0)

    def step(soft):
        module.zero_grad(set_to_none=True)
        out = training_step_backward(module, module, ids, mask, got.features, cfg, torch.Generator().manual_seed(0),
                                     label_ids=argmax, soft=soft)  # fmt: skip
        return out, [p.grad.clone() for p in module.parameters() if p.grad is not None]

    hard, g_hard = step(None)
    top1 = SoftLabels(ids=got.soft.ids[..., :1], logp=got.soft.logp[..., :1])
    one, g_one = step(top1)
    torch.testing.assert_close(one.loss, hard.loss)
    for a, b in zip(g_one, g_hard):
        torch.testing.assert_close(a, b)
    soft, g_soft = step(got.soft)
    assert torch.isfinite(soft.loss) and soft.loss != hard.loss
    assert g_soft and all(torch.isfinite(g).all() for g in g_soft) and sum(float(g.abs().sum()) for g in g_soft) > 0
