"""The selector stage on a tiny target: every head learns from the block cache alone (its loss on the
cached blocks falls) and stays lossless afterwards; the stage through Ray Train leaves the drafter bit
for bit as it was and reuses the cache on a second run."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from drelay_model.decoding import GenerationConfig, SpeculativeEngine
from drelay_model.drafter import BlockDrafter, DrafterConfig, save_drafter
from drelay_model.selectors import default_registry, trainable_selectors
from drelay_model.target import tiny_target
from drelay_model.training.selector_step import epoch_batches, selector_inputs, selector_step_backward
from drelay_model.training.step import StepConfig
from pipelines.train import block_cache
from pipelines.train.config import load_config
from pipelines.train.data import TrainSequence
from pipelines.train.features import FeatureSource

TINY = {"drelay": {"d_sel": 32, "read_dim": 32, "compact_dim": 16, "history_len": 8}, "dcoco": {"d": 16, "mlp": 16},
        "dflash2": {"rank": 8}, "domino": {"d": 16}, "dspark": {"rank": 8}}  # fmt: skip


@pytest.fixture(scope="module")
def cached(tmp_path_factory):
    """Tiny target, drafter, and a cache of 8 sequences whose responses are the target's greedy output."""
    target = tiny_target("tiny-llama")
    torch.manual_seed(0)
    # K = 32 of 256: enough adjacent-slot pairs with both labels in the pool for DCOCO's transition loss.
    drafter = BlockDrafter(DrafterConfig.for_target(target, num_layers=1, top_k=32), target).eval()
    g = torch.Generator().manual_seed(5)
    seqs = []
    for i in range(8):
        prompt = torch.randint(1, target.vocab_size, (4 + i % 3,), generator=g)
        out = target.hf.generate(prompt[None], max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None)[0]
        seqs.append(TrainSequence(f"g/{i}#0", tuple(out.tolist()), len(prompt)))
    cfg = load_config(None, [
        "target.spec=tiny-llama", "drafter.init_checkpoint=unused", "drafter.freeze=true", "selector.name=dflash2",
        "train.stage=selector", "train.scout_policy=native", "train.anchors_per_seq=8", "train.bf16=false",
        "data.block_cache_shard=4",
    ])  # fmt: skip
    lay = block_cache.layout(cfg, tmp_path_factory.mktemp("cache"), drafter, target, seqs)
    block_cache.build(lay, seqs, drafter, FeatureSource(target, drafter.config.target_layer_ids, None), cfg, torch.device("cpu"))
    return target, drafter, block_cache.load(lay, with_features=True), seqs


def _loss(sel, blocks, cfg) -> float:
    with torch.no_grad():
        inputs = selector_inputs(blocks, sel, cfg, torch.device("cpu"))
        return float(sel.training_loss(inputs).weighted_sum / inputs.valid.sum())


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "drelay" else n for n in trainable_selectors()])
def test_every_head_learns_from_the_cache_and_stays_lossless(cached, name):
    target, drafter, blocks, seqs = cached
    torch.manual_seed(1)
    sel = default_registry().create(name, drafter=drafter, config=TINY[name]).train()
    cfg = StepConfig(anchors_per_seq=8, native_fraction=0.5, scout_policy="native")
    opt = torch.optim.AdamW([p for p in sel.parameters() if p.requires_grad], lr=1e-2)
    before = _loss(sel, blocks, cfg)
    gen = torch.Generator().manual_seed(0)
    for epoch in range(6):
        for idx in epoch_batches(len(blocks), 16, gen):
            opt.zero_grad()
            out = selector_step_backward(sel, blocks.take(idx), cfg)
            assert torch.isfinite(out.loss)
            opt.step()
    after = _loss(sel, blocks, cfg)
    assert after < 0.8 * before, f"{name}: loss on the cached blocks {before:.4f} → {after:.4f}"
    sel.eval()
    prompts = [list(s.input_ids[: s.response_start]) for s in seqs[:3]]
    got = SpeculativeEngine(target, drafter, sel).generate(prompts, GenerationConfig(max_new_tokens=20)).tokens
    for p, tokens in zip(prompts, got):
        want = target.hf.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=None)
        assert tokens == want[0, len(p) :].tolist(), f"{name}: trained head changed the output"


@pytest.mark.slow
def test_the_stage_through_ray_keeps_the_drafter_and_reuses_its_cache(ray_session, uri, tmp_path):
    target = tiny_target("tiny-llama")
    torch.manual_seed(0)
    drafter = BlockDrafter(DrafterConfig.for_target(target, num_layers=1, top_k=8), target)
    save_drafter(drafter, tmp_path / "ck")
    g = torch.Generator().manual_seed(2)
    data = tmp_path / "seqs.jsonl"
    rows = [
        {"seq_id": f"r/{i}", "input_ids": torch.randint(1, 256, (30,), generator=g).tolist(), "response_start": 6}
        for i in range(12)
    ]
    data.write_text("".join(__import__("json").dumps(r) + "\n" for r in rows))
    from pipelines.train.driver import run_training

    def run(name, *extra):
        cfg = load_config(None, [
            "target.spec=tiny-llama", f"drafter.init_checkpoint={tmp_path / 'ck'}", "drafter.freeze=true",
            "selector.name=dflash2", "selector.config={rank: 8}", "train.stage=selector", "train.scout_policy=native",
            "train.anchors_per_seq=8", "train.seqs_per_step=1", "train.max_steps=6", "train.validate_every=2",
            "train.checkpoint_every=2", "train.validation_prompts=1", "train.early_stop_patience=10", f"data.regenerated={data}",
            "data.validation_fraction=0.1", "data.block_cache_shard=4", f"data.block_cache_dir={tmp_path / 'bc'}",
            f"ray.storage_path={tmp_path / 'ray'}", f"output_dir={tmp_path / 'out'}", f"ray.run_name={name}", *extra,
        ])  # fmt: skip
        return run_training(cfg)

    first = run("stage-a")
    shards = sorted((tmp_path / "bc").glob("*/shard-*.safetensors"))
    stamps = [p.stat().st_mtime_ns for p in shards]
    second = run("stage-b", "train.stop_at_step=4")  # ends at step 4 of a 6-step schedule
    assert sorted((tmp_path / "bc").glob("*/shard-*.safetensors")) == shards  # one cache, reused
    assert [p.stat().st_mtime_ns for p in shards] == stamps
    start = load_file(str(tmp_path / "ck" / "drafter.safetensors"))
    for result, end in ((first, 6), (second, 4)):  # the second stops at train.stop_at_step, schedules set for 6
        out = load_file(str(result.checkpoint / "drafter.safetensors"))
        assert all(torch.equal(out[k], v) for k, v in start.items()), "the frozen drafter changed"
        assert any(k.startswith("selector.") for k in out)
        assert result.metrics["step"] == end
