"""Block drafter: strict context rule, batching, draft vocabulary, checkpoints and their errors."""

from __future__ import annotations

import json

import pytest
import torch

from drelay_model.drafter import (
    BlockDrafter,
    DrafterConfig,
    build_draft_vocab,
    draft_vocab_coverage,
    load_drafter,
    save_drafter,
)
from drelay_model.errors import DRelayError
from drelay_model.kernels import cpu_linear
from drelay_model.kernels.cpu_linear import CpuKernels
from drelay_model.target import tiny_target


def _context(target, drafter, n: int, seed: int = 0):
    ids = torch.randint(0, target.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))
    feats = target(ids, target.new_cache(1, n), feature_layers=drafter.config.target_layer_ids).features
    return ids, feats


def test_block_sees_only_context_before_its_anchor(target, make_drafter):
    drafter = make_drafter(target)
    ids, feats = _context(target, drafter, 30)
    a = 17
    pos = torch.arange(30)[None]
    before = drafter.block_hidden(ids[:, a : a + 1], torch.tensor([[a]]), drafter.context_kv(feats, pos))
    feats2 = feats.clone()
    feats2[:, a:] = torch.randn_like(feats2[:, a:])  # change the anchor's and every later feature
    after = drafter.block_hidden(ids[:, a : a + 1], torch.tensor([[a]]), drafter.context_kv(feats2, pos))
    torch.testing.assert_close(before, after)
    feats3 = feats.clone()
    feats3[:, a - 1] += 1.0  # the last visible feature does matter
    moved = drafter.block_hidden(ids[:, a : a + 1], torch.tensor([[a]]), drafter.context_kv(feats3, pos))
    assert not torch.allclose(before, moved)


def test_many_blocks_at_once_equal_one_at_a_time(target, make_drafter):
    """Training runs M blocks per row in one pass; each must equal its own single-block forward."""
    drafter = make_drafter(target)
    ids, feats = _context(target, drafter, 40)
    ctx = drafter.context_kv(feats, torch.arange(40)[None])
    anchors = torch.tensor([[3, 11, 25, 39]])
    together = drafter.block_hidden(ids[:, anchors[0]], anchors, ctx)  # [1, 4, S, D]
    for m, a in enumerate(anchors[0].tolist()):
        alone = drafter.block_hidden(ids[:, a : a + 1], torch.tensor([[a]]), ctx)
        torch.testing.assert_close(together[:, m], alone[:, 0], atol=1e-5, rtol=1e-5)


def test_cached_draft_equals_full_context_draft(target, make_drafter):
    """Inference (incremental context cache) and training/replay (full context) agree."""
    drafter = make_drafter(target)
    ids, feats = _context(target, drafter, 24)
    cache = drafter.new_context_cache(1, 64)
    drafter.extend_context(feats[:, :10], cache)
    drafter.extend_context(feats[:, 10:20], cache)
    block = drafter.draft(ids[:, 20], cache)
    full = drafter.block_hidden(ids[:, 20:21], torch.tensor([[20]]), drafter.context_kv(feats, torch.arange(24)[None]))
    torch.testing.assert_close(block.hidden, full[:, 0, 1:], atol=1e-5, rtol=1e-5)
    assert block.cand_ids.shape == (1, drafter.config.num_slots, drafter.config.top_k)
    assert bool((block.cand_logq[..., :-1] >= block.cand_logq[..., 1:]).all())  # sorted, 0 = argmax


def test_draft_vocabulary_maps_back_to_target_ids(target):
    counts = torch.zeros(target.vocab_size)
    counts[torch.arange(0, target.vocab_size, 3)] = 5.0
    mapping = build_draft_vocab(counts, 40, always=(7,))
    assert mapping.shape == (40,) and 7 in mapping.tolist()
    assert draft_vocab_coverage(mapping, counts) > 0.4
    cfg = DrafterConfig.for_target(target, num_layers=1, draft_vocab_size=40)
    drafter = BlockDrafter(cfg, target, draft_to_target=mapping).eval()
    ids, feats = _context(target, drafter, 12)
    cache = drafter.new_context_cache(1, 32)
    drafter.extend_context(feats, cache)
    block = drafter.draft(ids[:, -1], cache)
    assert set(block.cand_ids.flatten().tolist()) <= set(mapping.tolist())
    torch.testing.assert_close(drafter.head_weight, target.lm_head_weight[mapping])


def test_checkpoint_roundtrip(tmp_path, target, make_drafter):
    drafter = make_drafter(target, seed=3)
    save_drafter(drafter, tmp_path / "ckpt", meta={"step": 7})
    loaded, extra, meta = load_drafter(tmp_path / "ckpt", target)
    assert meta == {"step": 7} and extra == {}
    for (name, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        torch.testing.assert_close(a, b, msg=name)
    assert "embed_weight" not in drafter.state_dict()  # frozen target weights are never saved


def test_checkpoint_errors_are_one_line(tmp_path, target, make_drafter):
    drafter = make_drafter(target)
    path = save_drafter(drafter, tmp_path / "ckpt")
    with pytest.raises(DRelayError, match="not found"):
        load_drafter(tmp_path / "missing", target)
    other = tiny_target("tiny-llama", hidden=32, heads=2, kv_heads=1)
    with pytest.raises(DRelayError, match="does not match target"):
        load_drafter(path, other)
    other_vocab = tiny_target(target.config.model_type.replace("llama", "tiny-llama").replace("qwen3", "tiny-qwen3"), vocab=300)
    with pytest.raises(DRelayError, match="different target"):
        load_drafter(path, other_vocab)

    (path / "drafter.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(DRelayError, match="corrupted"):
        load_drafter(path, target)

    path = save_drafter(drafter, tmp_path / "ckpt2")
    doc = json.loads((path / "drafter_config.json").read_text())
    doc["drafter"]["intermediate_size"] += 8  # weights no longer fit the declared shapes
    (path / "drafter_config.json").write_text(json.dumps(doc))
    with pytest.raises(DRelayError, match="has shape"):
        load_drafter(path, target)

    doc["drafter"]["colour"] = "blue"
    (path / "drafter_config.json").write_text(json.dumps(doc))
    with pytest.raises(DRelayError, match="unknown keys: colour"):
        load_drafter(path, target)
    (path / "drafter_config.json").write_text("{not json")
    with pytest.raises(DRelayError, match="corrupted"):
        load_drafter(path, target)


def test_interrupted_save_leaves_the_old_checkpoint(tmp_path, target, make_drafter, monkeypatch):
    drafter = make_drafter(target)
    path = save_drafter(drafter, tmp_path / "ckpt", meta={"v": 1})
    import drelay_model.drafter.checkpoint as ck

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.torch.save_file", boom)
    with pytest.raises(OSError):
        ck.save_drafter(drafter, path, meta={"v": 2})
    assert load_drafter(path, target)[2] == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


@pytest.mark.parametrize("field, value", [("block_size", 1), ("top_k", 0), ("target_layer_ids", ()), ("num_heads", 5)])
def test_bad_drafter_config_names_the_field(target, field, value):
    with pytest.raises(DRelayError, match=field):
        DrafterConfig.for_target(target, **{field: value})


def test_a_short_block_drafts_only_its_slots(target, make_drafter):
    """draft(slots=h) runs a block of the anchor and h masked positions (the cost-aware round's
    partial draft): h slots in the pool, equal to block_hidden over a block of that size; h = H is
    the whole block."""
    drafter = make_drafter(target, cpu_kernels=CpuKernels(int8_draft=False))  # float32 throughout (int8: below)
    ids, feats = _context(target, drafter, 20)
    cache = drafter.new_context_cache(1, 48)
    drafter.extend_context(feats, cache)
    H = drafter.config.num_slots
    ctx = drafter.context_kv(feats, torch.arange(20)[None])
    for h in (1, 3):
        block = drafter.draft(ids[:, -1], cache, slots=h)
        assert block.cand_ids.shape == (1, h, drafter.config.top_k)
        short = drafter.block_hidden(ids[:, -1:], torch.tensor([[20]]), ctx, size=1 + h)
        torch.testing.assert_close(block.hidden, short[:, 0, 1:], atol=1e-5, rtol=1e-5)
    whole = drafter.draft(ids[:, -1], cache, slots=H)
    torch.testing.assert_close(whole.hidden, drafter.draft(ids[:, -1], cache).hidden)
    int8 = make_drafter(target, cpu_kernels=CpuKernels())  # the same weights, int8 short blocks allowed
    if int8.cpu_kernels.active("cpu", torch.float32).int8_draft:  # ≤ INT8_MAX_ROWS positions: int8 layer weights
        quantized = int8.draft(ids[:, -1], cache, slots=1).hidden
        exact = drafter.block_hidden(ids[:, -1:], torch.tensor([[20]]), ctx, size=2)[:, 0, 1:]
        assert not torch.equal(quantized, exact)
        torch.testing.assert_close(quantized, exact, atol=0.05, rtol=0.05)
        assert torch.equal(whole.hidden, int8.draft(ids[:, -1], cache).hidden)  # 16 positions: float32


@pytest.mark.parametrize("precision", ["bfloat16", "int8"])
def test_the_coarsely_ranked_pool_keeps_float32_logits(target, make_drafter, precision):
    """Where the CPU can, the pool is ranked by a bf16 head (native bf16) or an int8 one (elsewhere)
    and its members get float32 logits: the same argmax wherever the float32 top two are not within
    the coarse rounding, log q within the normaliser's coarse error, sorted; with both switched off
    the pool is float32."""
    if precision == "bfloat16" and not cpu_linear.bf16_native():
        pytest.skip("no native bf16 oneDNN linear on this CPU")
    if precision == "int8" and not (cpu_linear.available() and cpu_linear.int8_kernel()):
        pytest.skip("this torch build has no weight-only int8 matmul")
    coarse = make_drafter(target, cpu_kernels=CpuKernels(bf16_pool=precision == "bfloat16"))  # int8 ranks where bf16 is off
    plain = make_drafter(target, cpu_kernels=CpuKernels(bf16_pool=False, int8_draft=False))  # the same weights
    assert coarse.cpu_kernels.active("cpu", torch.float32).rank_dtype() == getattr(torch, precision)
    assert plain.cpu_kernels.active("cpu", torch.float32).rank_dtype() is None
    hidden = torch.randn(3, 2, target.hidden_size, generator=torch.Generator().manual_seed(0)) * 4
    few = hidden[:2]  # 4 rows: within INT8_MAX_ROWS
    with torch.inference_mode():
        ranked, many = coarse.pool(few), coarse.pool(hidden)
        exact, exact_many = plain.pool(few), plain.pool(hidden)
        top2 = torch.log_softmax(plain.logits(few), -1).topk(2, dim=-1).values
    if precision == "int8":  # more rows than INT8_MAX_ROWS: the float32 head is the faster ranking
        assert torch.equal(many.cand_ids, exact_many.cand_ids) and torch.equal(many.cand_logq, exact_many.cand_logq)
    clear = (top2[..., 0] - top2[..., 1]) > 0.1
    assert clear.any() and torch.equal(ranked.cand_ids[..., 0][clear], exact.cand_ids[..., 0][clear])
    torch.testing.assert_close(ranked.cand_logq[..., 0], exact.cand_logq[..., 0], atol=0.05, rtol=0)
    assert not torch.equal(ranked.cand_logq, exact.cand_logq)  # the coarse pass did run
    assert bool((ranked.cand_logq[..., :-1] >= ranked.cand_logq[..., 1:]).all()) and bool((ranked.cand_logq <= 0).all())


def test_grown_layers_start_as_the_identity_and_then_learn(tmp_path, target, make_drafter):
    """Depth growth (`drafter.grow_layers`): appended layers draft exactly as before, get a gradient
    at their zeroed output projections, and a grown drafter saves and loads at its new depth."""
    drafter = make_drafter(target)
    depth = drafter.config.num_layers
    ids, feats = _context(target, drafter, 24)
    anchors, pos = torch.tensor([[5, 20]]), torch.arange(24)[None]
    before = drafter.block_hidden(ids[:, anchors[0]], anchors, drafter.context_kv(feats, pos))
    torch.manual_seed(3)
    drafter.grow(1)
    assert drafter.config.num_layers == len(drafter.layers) == depth + 1
    after = drafter.block_hidden(ids[:, anchors[0]], anchors, drafter.context_kv(feats, pos))
    assert torch.equal(before, after)  # x + 0 + 0: bit for bit
    drafter.train()
    drafter.block_hidden(ids[:, anchors[0]], anchors, drafter.context_kv(feats, pos)).square().sum().backward()
    new = drafter.layers[-1]
    assert new.o_proj.weight.grad is not None and bool(new.o_proj.weight.grad.abs().sum() > 0)
    save_drafter(drafter, tmp_path / "grown")
    loaded, _, _ = load_drafter(tmp_path / "grown", target)
    assert loaded.config.num_layers == depth + 1
    with pytest.raises(ValueError, match="extra_layers"):
        drafter.grow(0)
