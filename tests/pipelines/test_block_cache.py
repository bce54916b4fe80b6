"""The selector stage's block cache on a tiny target: fingerprints, resume, shard reading, bad configs."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from drelay_model.drafter import BlockDrafter, DrafterConfig, save_drafter
from drelay_model.errors import DRelayError
from drelay_model.target import tiny_target
from drelay_model.training.step import history_windows
from pipelines.common.paths import REPO_ROOT
from pipelines.train import block_cache
from pipelines.train.config import load_config
from pipelines.train.data import TrainSequence, collate
from pipelines.train.features import FeatureSource


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target, a drafter checkpoint and 5 sequences (prompt 5 + response 24–31 tokens)."""
    target = tiny_target("tiny-llama")
    torch.manual_seed(0)
    drafter = BlockDrafter(DrafterConfig.for_target(target, num_layers=1, top_k=8), target).eval()
    ck = tmp_path_factory.mktemp("ck") / "drafter"
    save_drafter(drafter, ck)
    g = torch.Generator().manual_seed(3)
    seqs = [
        TrainSequence(f"s/{i}#0", tuple(torch.randint(1, target.vocab_size, (29 + i,), generator=g).tolist()), 5)
        for i in range(5)
    ]
    return target, drafter, ck, seqs


def config(ck, *extra):
    return load_config(None, [
        "target.spec=tiny-llama", f"drafter.init_checkpoint={ck}", "drafter.freeze=true", "selector.name=dflash2",
        "train.stage=selector", "train.scout_policy=native", "train.anchors_per_seq=8", "train.bf16=false",
        "data.block_cache_shard=2", *extra,
    ])  # fmt: skip


def build(cfg, root, target, drafter, seqs):
    lay = block_cache.layout(cfg, root, drafter, target, seqs)
    features = FeatureSource(target, drafter.config.target_layer_ids, None, bf16=False)
    manifest = block_cache.build(lay, seqs, drafter, features, cfg, torch.device("cpu"))
    return lay, manifest


def test_same_inputs_reuse_the_cache_and_any_change_builds_a_new_one(setup, tmp_path):
    target, drafter, ck, seqs = setup
    lay, manifest = build(config(ck), tmp_path, target, drafter, seqs)
    assert lay.complete() and manifest["shards"] == 3 and manifest["blocks"] > 0
    again = block_cache.layout(config(ck), tmp_path, drafter, target, seqs)
    assert again.fingerprint == lay.fingerprint and again.complete()
    fewer = block_cache.layout(config(ck, "data.block_cache_sequences=3"), tmp_path, drafter, target, seqs)
    assert fewer.fingerprint == lay.fingerprint and fewer.num_shards == 2 and fewer.complete()  # its first shards
    assert len(block_cache.load(fewer, with_features=False)) < manifest["blocks"]
    changed = [
        block_cache.layout(config(ck, "train.anchors_per_seq=6"), tmp_path, drafter, target, seqs),
        block_cache.layout(config(ck, "train.seed=1"), tmp_path, drafter, target, seqs),
        block_cache.layout(config(ck), tmp_path, drafter, target, seqs[:4]),
    ]
    other = BlockDrafter(drafter.config, target).eval()
    other.load_state_dict(drafter.state_dict())
    with torch.no_grad():
        other.fc.weight[0, 0] += 1e-3  # one weight of the drafter's own, slightly
    changed.append(block_cache.layout(config(ck), tmp_path, other, target, seqs))
    prints = {c.fingerprint for c in changed}
    assert len(prints) == 4 and lay.fingerprint not in prints
    assert not any(c.complete() for c in changed)  # each would be built anew


def test_a_killed_build_resumes_at_the_missing_shards(setup, tmp_path):
    target, drafter, ck, seqs = setup
    cfg = config(ck)
    lay, _ = build(cfg, tmp_path, target, drafter, seqs)
    before = {i: lay.shard(i).read_bytes() for i in range(lay.num_shards)}
    kept = lay.shard(0).stat().st_mtime_ns
    # What a kill mid-build leaves: shard 1 and the manifest never written, a torn temp file.
    lay.shard(1).unlink()
    lay.manifest.unlink()
    lay.shard(1).with_suffix(".999.tmp").write_bytes(b"torn")
    assert not block_cache.layout(cfg, tmp_path, drafter, target, seqs).complete()
    lay2, manifest = build(cfg, tmp_path, target, drafter, seqs)
    assert lay2.missing() == [] and lay2.complete() and manifest["shards"] == 3
    assert lay.shard(0).stat().st_mtime_ns == kept  # not rebuilt
    assert {i: lay.shard(i).read_bytes() for i in range(3)} == before  # the rebuilt shard is bit for bit the same


def test_shards_read_back_the_blocks_the_drafter_drafts(setup, tmp_path):
    target, drafter, ck, seqs = setup
    cfg = config(ck)
    lay, manifest = build(cfg, tmp_path, target, drafter, seqs)
    blocks = block_cache.load(lay, with_features=True)
    assert len(blocks) == manifest["blocks"]
    assert block_cache.load(lay, with_features=False).features is None
    features = FeatureSource(target, drafter.config.target_layer_ids, None, bf16=False)
    H, n = drafter.config.num_slots, 6
    win, mask = blocks.history(n)
    start = 0
    for s, seq in enumerate(seqs):  # shard-local rows re-based: each block reads its own sequence
        ids, _ = collate([seq])
        feats = features([seq])
        rows = (blocks.feat_row >= start) & (blocks.feat_row < start + len(seq.input_ids))
        pos = blocks.anchor_pos[rows].long()
        assert rows.sum() > 0 and torch.equal(blocks.anchor_ids[rows].long(), ids[0, pos])
        want, want_mask = history_windows(feats.to(torch.bfloat16).float(), pos[None], n)
        assert torch.equal(mask[rows], want_mask)
        torch.testing.assert_close(win[rows], want, atol=2e-2, rtol=1e-2)  # bf16 storage of a batched forward
        with torch.no_grad():
            hidden = drafter(ids[:, pos], pos[None], feats)[0, :, 1:]  # [M, H, D]
            pool = drafter.pool(hidden)
            logq = torch.log_softmax(drafter.logits(hidden), -1)  # [M, H, V]
        # The same pool up to float rounding (the cache drafts batches of sequences, padded; near-ties
        # may swap): a block read from the wrong sequence or anchor would differ by O(1).
        cached = blocks.cand_ids[rows].long()
        torch.testing.assert_close(blocks.cand_logq[rows], pool.cand_logq, atol=2e-2, rtol=0)
        torch.testing.assert_close(logq.gather(-1, cached), pool.cand_logq, atol=2e-2, rtol=0)
        assert (cached == pool.cand_ids).float().mean() > 0.9
        for r, a in zip(torch.nonzero(rows)[:, 0].tolist(), pos.tolist()):
            m = blocks.valid[r]
            assert torch.equal(blocks.labels[r][m].long(), ids[0, a + 1 : a + 1 + H][: int(m.sum())])
        start += len(seq.input_ids)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            ["drafter.freeze=false"],
            "train.stage: 'selector' trains the head alone on cached blocks; it needs drafter.freeze=true",
        ),
        (["train.scout_policy=selector"], "needs train.scout_policy=native"),
        (["data.block_cache_shard=0"], "data.block_cache_shard: Input should be greater than or equal to 1"),
        (
            ["train.stage=joint", "drafter.freeze=false"],
            "train.early_stop_patience / train.stop_at_step / train.cooldown_steps: only the selector stage",
        ),
        (["train.max_steps=10", "train.stop_at_step=11"], "train.stop_at_step must be ≤ train.max_steps"),
    ],
)
def test_bad_stage_configs_are_one_line_errors(setup, override, message):
    _, _, ck, _ = setup
    with pytest.raises(DRelayError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config(ck, "train.early_stop_patience=2", *override)


def test_drelay_train_rejects_a_stage_without_a_frozen_drafter_in_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "cli", "train", "--dry-run", "train.stage=selector"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "drafter.freeze=true" in lines[0], proc.stderr


def test_the_cache_order_mixes_sources_so_any_first_shards_sample_all_of_them():
    """The corpus file holds each source together: the cache's seeded order must not."""
    seqs = [TrainSequence(f"{src}/{i}#0", (1, 2, 3), 1) for src in ("a", "b", "c", "d") for i in range(50)]
    order = block_cache.cache_order(seqs, 0)
    assert sorted(s.seq_id for s in order) == sorted(s.seq_id for s in seqs)  # a permutation
    assert order == block_cache.cache_order(seqs, 0) and order != block_cache.cache_order(seqs, 1)
    assert {s.seq_id.split("/")[0] for s in order[:20]} == {"a", "b", "c", "d"}
