"""Training on partial blocks (`train.partial_blocks`): a block masked to its first L slots is the
block a cost-aware round drafts (`draft(slots=L)`), the step supervises those L slots only, and a
selector is refused."""

from __future__ import annotations

import pytest
import torch

from drelay_model.decoding import GenerationConfig, SpeculativeEngine
from drelay_model.selectors import default_registry
from drelay_model.training.step import DraftTrainModule, StepConfig, training_step
from drelay_model.training.step import _plan as plan_step


def _context(target, drafter, n: int):
    ids = torch.randint(0, target.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    feats = target(ids, target.new_cache(1, n), feature_layers=drafter.config.target_layer_ids).features
    return ids, feats, drafter.context_kv(feats, torch.arange(n)[None])


def test_a_masked_block_drafts_what_a_partial_block_drafts(target, make_drafter):
    """Blocks of lengths 1, 4, H and 9 side by side: each one's first L slots equal the partial block
    of L slots drafted alone (`block_hidden(size=1 + L)`, what `draft(slots=L)` runs)."""
    drafter = make_drafter(target)
    H = drafter.config.num_slots
    ids, _, ctx = _context(target, drafter, 40)
    anchors = torch.tensor([[5, 12, 26, 39]])
    block_len = torch.tensor([[1, 4, H, 9]])
    masked = drafter.block_hidden(ids[:, anchors[0]], anchors, ctx, block_len=block_len)  # [1, 4, S, D]
    whole = drafter.block_hidden(ids[:, anchors[0]], anchors, ctx)
    for m, (a, L) in enumerate(zip(anchors[0].tolist(), block_len[0].tolist())):
        alone = drafter.block_hidden(ids[:, a : a + 1], torch.tensor([[a]]), ctx, size=1 + L)  # [1, 1, 1 + L, D]
        torch.testing.assert_close(masked[:, m, : 1 + L], alone[:, 0], atol=1e-5, rtol=1e-5)
        if L < H:  # and differs from the whole block's estimate of the same slots
            assert not torch.allclose(masked[:, m, 1 : 1 + L], whole[:, m, 1 : 1 + L], atol=1e-4)
    torch.testing.assert_close(masked[:, 2], whole[:, 2], atol=1e-5, rtol=1e-5)  # L = H: the whole block


def _data(target, drafter, n: int = 3, new: int = 24):
    """Prompts + the target's greedy continuations as a batch: ids, response mask, target features."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, target.vocab_size, (6,), generator=g).tolist() for _ in range(n)]
    outs = SpeculativeEngine(target).generate(prompts, GenerationConfig(max_new_tokens=new)).tokens
    N = max(len(p) + len(o) for p, o in zip(prompts, outs))
    ids, mask = torch.zeros(n, N, dtype=torch.long), torch.zeros(n, N, dtype=torch.bool)
    for b, (p, o) in enumerate(zip(prompts, outs)):
        ids[b, : len(p) + len(o)] = torch.tensor(p + o)
        mask[b, len(p) : len(p) + len(o)] = True
    feats = target(ids, target.new_cache(n, N), feature_layers=drafter.config.target_layer_ids).features
    return ids, mask, feats


def test_the_step_supervises_the_drafted_slots_only(target, make_drafter):
    drafter = make_drafter(target, num_layers=1, top_k=8)
    H = drafter.config.num_slots
    module = DraftTrainModule(drafter, None)
    ids, mask, feats = _data(target, drafter)
    whole = plan_step(
        module, ids, mask, feats, ids, StepConfig(anchors_per_seq=6, native_fraction=0.0), torch.Generator().manual_seed(2)
    )
    assert whole.block_len is None
    cfg = StepConfig(anchors_per_seq=6, native_fraction=0.0, partial_blocks=1.0)
    part = plan_step(module, ids, mask, feats, ids, cfg, torch.Generator().manual_seed(2))
    assert part.block_len.shape == part.anchors.shape and int(part.block_len.min()) >= 1 and int(part.block_len.max()) < H
    slot = torch.arange(H)
    assert torch.equal(part.blocks.valid, whole.blocks.valid & (slot < part.block_len[..., None]))  # the same anchors, cut
    assert part.denom == part.blocks.valid.sum() < whole.denom
    half = plan_step(module, ids, mask, feats, ids, StepConfig(anchors_per_seq=6, native_fraction=0.0, partial_blocks=0.5),
                     torch.Generator().manual_seed(2))  # fmt: skip
    assert (half.block_len == H).any() and (half.block_len < H).any()
    out = training_step(module, module, ids, mask, feats, cfg, torch.Generator().manual_seed(2))
    out.loss.backward()
    assert torch.isfinite(out.loss) and out.metrics["valid_tokens"] == float(part.blocks.valid.sum())
    assert all(p.grad is not None for p in drafter.parameters() if p.requires_grad)


def test_a_selector_is_refused_in_the_step_and_in_the_config(target, make_drafter, tmp_path):
    drafter = make_drafter(target, num_layers=1, top_k=8)
    selector = default_registry().create("drelay", drafter=drafter, config={"d_sel": 32, "read_dim": 32, "history_len": 8})
    module = DraftTrainModule(drafter, selector)
    ids, mask, feats = _data(target, drafter)
    cfg = StepConfig(anchors_per_seq=4, native_fraction=0.0, partial_blocks=0.5)
    with pytest.raises(ValueError, match="partial blocks train the drafter alone"):
        training_step(module, module, ids, mask, feats, cfg, torch.Generator().manual_seed(0))

    from drelay_model.errors import DRelayError
    from pipelines.train.config import load_config

    with pytest.raises(DRelayError, match="train.partial_blocks trains the drafter alone"):
        load_config(None, ["train.partial_blocks=0.5", "selector.name=drelay"])
    with pytest.raises(DRelayError, match="train.partial_blocks"):
        load_config(None, ["train.partial_blocks=1.5"])
    assert load_config(None, ["train.partial_blocks=0.5"]).train.partial_blocks == 0.5
