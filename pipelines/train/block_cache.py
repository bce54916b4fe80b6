"""The selector stage's block cache: what a frozen drafter drafts, computed once and read many times.

With `drafter.freeze`, a training block's drafter outputs never change, so the selector stage
(`train.stage: selector`) drafts every block once and trains only the head on the stored result —
across epochs, heads and sweep trials. Per block (R blocks, H slots, K pool entries, D drafter width,
F = L·D target feature width):

    hidden      [R, H, D]  bfloat16  slot hidden states (the drafter's bf16 autocast output)
    cand_ids    [R, H, K]  int32     the pool, target ids (candidate 0 = the argmax)
    cand_logq   [R, H, K]  float32   pool log-probabilities (draft softmax)
    anchor_ids  [R] int32, anchor_pos [R] int32 (position in its sequence), feat_row [R] int64 (the
                anchor's row in `features`), labels [R, H] int32 (the target's greedy tokens), valid [R, H] bool
    features    [T, F]     bfloat16  each cached sequence's target features, concatenated (the
                verified-history window a head reads is rows feat_row − n … feat_row − 1)

Anchors are drawn as in a joint step — `anchors_per_seq` per sequence, the share
`native_anchor_fraction.end` traced by the argmax scout — once, from a seeded generator per shard.

Layout: `<data.block_cache_dir>/<fingerprint>/shard-00000.safetensors …` — shard i holds sequences
i·S … (i+1)·S − 1 (S = `data.block_cache_shard`) of the training set in a seeded random order
(`cache_order`: the corpus file groups sources and near-duplicate conversations, so any prefix of
shards must sample all of them), each written to a temp name then renamed,
so a killed build resumes at the first missing shard — and `manifest.json` (blocks, bytes, build
time) once the shards a run needs exist. The fingerprint hashes everything a block depends on: the
drafter's tensors, the target and its feature layers, the training sequences' token ids (all of them,
in order), the anchor settings, the precision, the shard size and the seed — change any and the stage
builds a new cache. `data.block_cache_sequences` only says how many shards a run reads: a run asking
for more sequences extends the same cache, one asking for fewer reads its first shards.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from drelay_model.errors import DRelayError
from drelay_model.training.anchors import eligible_anchors, make_blocks, sample_uniform_anchors, scout_anchors
from drelay_model.training.head import chunked_head
from drelay_model.training.selector_step import CachedBlocks
from pipelines.train.config import RunConfig
from pipelines.train.data import TrainSequence, collate

CACHE_VERSION = 2
BUILD_BATCH = 4  # sequences per drafter pass while building


@dataclass(frozen=True)
class CacheLayout:
    """Where one cache lives and what it holds: `spec` is what its fingerprint hashes."""

    root: Path
    spec: dict
    num_shards: int

    @property
    def fingerprint(self) -> str:
        return hashlib.sha1(json.dumps(self.spec, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def dir(self) -> Path:
        return self.root / self.fingerprint

    def shard(self, i: int) -> Path:
        return self.dir / f"shard-{i:05d}.safetensors"

    @property
    def manifest(self) -> Path:
        return self.dir / "manifest.json"

    def complete(self) -> bool:
        """Every shard this run reads exists and the manifest covers them."""
        if self.missing() or not self.manifest.is_file():
            return False
        return json.loads(self.manifest.read_text())["shards"] >= self.num_shards

    def missing(self) -> list[int]:
        return [i for i in range(self.num_shards) if not self.shard(i).is_file()]


def tensor_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha1 over names, dtypes, shapes and bytes: equal iff the tensors are bit for bit equal."""
    h = hashlib.sha1()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def sequence_digest(seqs: list[TrainSequence]) -> str:
    h = hashlib.sha1()
    for s in seqs:
        h.update(f"{s.seq_id}|{s.response_start}|{','.join(map(str, s.input_ids))}\n".encode())
    return h.hexdigest()


def cache_order(seqs: list[TrainSequence], seed: int) -> list[TrainSequence]:
    """The training sequences in the cache's order: a seeded shuffle, so the first shards sample every
    source (the corpus file holds each source, and runs of near-identical conversations, together)."""
    order = list(range(len(seqs)))
    random.Random(seed * 1_000_003 + 17).shuffle(order)
    return [seqs[i] for i in order]


def layout(cfg: RunConfig, root: Path, drafter, target, seqs: list[TrainSequence]) -> CacheLayout:
    """The cache for this drafter + data + anchor settings (see the module docstring); the run reads
    the shards of its first `data.block_cache_sequences` sequences (all: None)."""
    t, d = cfg.train, drafter.config
    spec = {
        "version": CACHE_VERSION,
        "drafter": tensor_digest(drafter.state_dict()),
        "target": [target.name, list(d.target_layer_ids), target.hidden_size],
        "data": sequence_digest(seqs),  # every training sequence: the shards hold its prefix
        "anchors": [t.anchors_per_seq, t.native_anchor_fraction.end, t.scout_restart, t.seed],
        "pool": [d.num_slots, d.top_k],
        "bf16": t.bf16,
        "shard": cfg.data.block_cache_shard,
    }
    shard, n = cfg.data.block_cache_shard, min(cfg.data.block_cache_sequences or len(seqs), len(seqs))
    return CacheLayout(root=Path(root), spec=spec, num_shards=(n + shard - 1) // shard)


@torch.no_grad()
def draft_blocks(drafter, ids, mask, feats, cfg: RunConfig, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Anchors (uniform + argmax scout) and the frozen drafter's blocks for B sequences.
    ids, mask [B, N]; feats [B, N, F] → the block tensors of the valid anchors (module docstring)."""
    B, N = ids.shape
    H, M = drafter.config.num_slots, cfg.train.anchors_per_seq
    n_native = int(round(M * cfg.train.native_anchor_fraction.end))
    anchors, ok = sample_uniform_anchors(eligible_anchors(mask), M - n_native, gen)
    amp = dict(device_type=ids.device.type, dtype=torch.bfloat16, enabled=cfg.train.bf16)
    with torch.autocast(**amp):
        if n_native:
            ctx = drafter.context_kv(feats, torch.arange(N, device=ids.device)[None].expand(B, N))
            nat, nat_ok = scout_anchors(drafter, ctx, ids, ids, mask, n_native, gen, restart=cfg.train.scout_restart)
            anchors, ok = torch.cat([anchors, nat], 1), torch.cat([ok, nat_ok], 1)
        blocks = make_blocks(ids, mask, anchors, ok, H)
        hidden = drafter(torch.gather(ids, 1, anchors), anchors, feats)[:, :, 1:]  # [B, M, H, D]
        M = anchors.shape[1]
        labels, valid = blocks.labels.reshape(B * M, H), blocks.valid.reshape(B * M, H)
        head = chunked_head(drafter, hidden.reshape(B * M, H, -1), labels, valid, chunk_tokens=cfg.train.chunk_tokens)
    keep = valid[:, 0]  # real anchors (a padding anchor has no valid slot)
    seq = torch.arange(B, device=ids.device)[:, None].expand(B, M).reshape(-1)
    return {
        "hidden": head.block.hidden[keep].to(torch.bfloat16),
        "cand_ids": head.block.cand_ids[keep].to(torch.int32),
        "cand_logq": head.block.cand_logq[keep].float(),
        "anchor_ids": torch.gather(ids, 1, anchors).reshape(-1)[keep].to(torch.int32),
        "anchor_pos": anchors.reshape(-1)[keep].to(torch.int32),
        "seq": seq[keep].to(torch.int32),
        "labels": labels[keep].to(torch.int32),
        "valid": valid[keep],
    }


def build_shard(lay: CacheLayout, i: int, seqs: list[TrainSequence], drafter, features, cfg: RunConfig, device) -> int:
    """Draft shard i's sequences and write it atomically; returns its number of blocks."""
    parts, feats_out, rows = [], [], 0
    gen = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + i)
    for s in range(0, len(seqs), BUILD_BATCH):
        batch = seqs[s : s + BUILD_BATCH]
        ids, mask = (t.to(device) for t in collate(batch))
        feats = features(batch).to(device)
        part = draft_blocks(drafter, ids, mask, feats, cfg, gen)
        lengths = [len(q.input_ids) for q in batch]
        starts = torch.tensor([rows + sum(lengths[:b]) for b in range(len(batch))], device=device)
        part["feat_row"] = starts[part.pop("seq").long()] + part["anchor_pos"].long()
        parts.append({k: v.cpu() for k, v in part.items()})
        feats_out += [feats[b, :n].to(torch.bfloat16).cpu() for b, n in enumerate(lengths)]
        rows += sum(lengths)
    shard = {k: torch.cat([p[k] for p in parts]).contiguous() for k in parts[0]}
    shard["features"] = torch.cat(feats_out).contiguous()
    tmp = lay.shard(i).with_suffix(f".{os.getpid()}.tmp")
    save_file(shard, str(tmp))
    tmp.replace(lay.shard(i))
    return int(shard["anchor_ids"].shape[0])


def build(lay: CacheLayout, seqs, drafter, features, cfg: RunConfig, device, *, rank: int = 0, world: int = 1) -> dict:
    """Build the shards this rank owns (i ≡ rank mod world) that are missing, with a progress bar on
    rank 0; rank 0 then waits for every shard and writes the manifest. Returns the manifest."""
    from tqdm import tqdm

    lay.dir.mkdir(parents=True, exist_ok=True)
    mine = [i for i in lay.missing() if i % world == rank]
    shard = cfg.data.block_cache_shard
    started = time.perf_counter()
    bar = tqdm(total=lay.num_shards, initial=lay.num_shards - len(lay.missing()), desc="block cache", unit="shard",
               disable=rank != 0, mininterval=5.0)  # fmt: skip
    for i in mine:
        build_shard(lay, i, seqs[i * shard : (i + 1) * shard], drafter, features, cfg, device)
        bar.update(world)
    bar.close()
    while lay.missing():  # other ranks' shards
        time.sleep(1.0)
    if rank == 0 and not lay.complete():  # (re)written for the shards this run reads
        write_manifest(lay, build_seconds=time.perf_counter() - started)
    while not lay.complete():
        time.sleep(0.5)
    return json.loads(lay.manifest.read_text())


def write_manifest(lay: CacheLayout, *, build_seconds: float) -> None:
    from safetensors import safe_open

    blocks = 0
    for i in range(lay.num_shards):
        with safe_open(str(lay.shard(i)), "pt") as f:
            blocks += f.get_slice("anchor_ids").get_shape()[0]
    size = sum(lay.shard(i).stat().st_size for i in range(lay.num_shards))
    doc = {"fingerprint": lay.fingerprint, "spec": lay.spec, "shards": lay.num_shards, "blocks": blocks, "bytes": size,
           "bytes_per_1000_blocks": round(size * 1000 / max(blocks, 1)), "build_seconds": round(build_seconds, 1)}  # fmt: skip
    tmp = lay.manifest.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=2))
    tmp.replace(lay.manifest)


def load(lay: CacheLayout, *, with_features: bool, rank: int = 0, world: int = 1) -> CachedBlocks:
    """The shards i ≡ rank (mod world), concatenated (feature rows re-based per shard): each worker
    holds and trains on its own share; `features` only when a head reads a history window."""
    parts, feats, base = [], [], 0
    for i in range(rank, lay.num_shards, world):
        t = load_file(str(lay.shard(i)))
        f = t.pop("features")
        t["feat_row"] = t["feat_row"] + base
        base += f.shape[0]
        parts.append(t)
        if with_features:
            feats.append(f)
    if not parts:
        raise DRelayError(f"data.block_cache_sequences: {lay.num_shards} shard(s) for {world} workers; give every worker one")
    cat = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    return CachedBlocks(**cat, features=torch.cat(feats) if with_features else None)
