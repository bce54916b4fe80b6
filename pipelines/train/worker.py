"""The Ray Train worker loop: one process per worker, DDP over gloo (CPU) or NCCL (GPU).

Per step: the frozen target computes context features for a batch of sequences (no grad), the
drafter trains on anchor blocks (uniform + scout-traced), the optimizer steps. Rank 0 logs metrics to
the job's MLflow run, validates with greedy replay τ, and writes checkpoints; every rank reports to
Ray Train at the same cadence. A restarted worker group resumes from the latest checkpoint: model,
optimizer, step (which fixes the data position, since batch order is a function of seed and epoch).
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

import torch

from drelay_model.decoding import replay
from drelay_model.drafter import BlockDrafter, DrafterConfig, build_draft_vocab, load_drafter, save_drafter
from drelay_model.target import load_target
from drelay_model.training import StepConfig, drafter_step, lr_at
from pipelines.config import RunConfig
from pipelines.train.features import FeatureSource
from pipelines.train.data import batch_order, collate, label_counts, read_sequences, split_validation

TRAINER_STATE = "trainer_state.pt"


def build_drafter(cfg: RunConfig, target, train_seqs) -> BlockDrafter:
    d = cfg.drafter
    if d.init_checkpoint:
        return load_drafter(d.init_checkpoint, target)[0]
    overrides = dict(num_layers=d.num_layers, block_size=d.block_size, top_k=d.top_k, draft_vocab_size=d.draft_vocab_size)
    if d.target_layer_ids is not None:
        overrides["target_layer_ids"] = tuple(d.target_layer_ids)
    if d.intermediate_size is not None:
        overrides["intermediate_size"] = d.intermediate_size
    mapping = None
    if d.draft_vocab_size is not None:
        counts = label_counts(train_seqs, target.vocab_size)
        mapping = build_draft_vocab(counts, d.draft_vocab_size, always=target.eos_token_ids)
    torch.manual_seed(cfg.train.seed)  # identical initial weights on every worker
    return BlockDrafter(DrafterConfig.for_target(target, **overrides), target, draft_to_target=mapping)


def _abs_path(path: str) -> Path:
    from pipelines.tracking import REPO_ROOT

    p = Path(path).expanduser()
    return p if p.is_absolute() else REPO_ROOT / p


def validate(target, drafter, val_seqs, n: int) -> dict[str, float]:
    """Greedy replay τ (native) and oracle τ on the first n held-out sequences."""
    seqs = val_seqs[:n]
    if not seqs:
        return {}
    prompts = [list(s.input_ids[: s.response_start]) for s in seqs]
    conts = [list(s.input_ids[s.response_start :]) for s in seqs]
    drafter.eval()
    native = replay(target, drafter, prompts, conts)
    oracle = replay(target, drafter, prompts, conts, oracle=True)
    drafter.train()
    return {"val/tau_native": native.tau, "val/tau_oracle": oracle.tau}


def _save(path: Path, drafter, optimizer, step: int, cfg: RunConfig) -> None:
    save_drafter(drafter, path / "drafter", meta={"step": step, "run_name": cfg.ray.run_name})
    torch.save({"optimizer": optimizer.state_dict(), "step": step}, path / TRAINER_STATE)
    (path / "run_config.json").write_text(cfg.model_dump_json(indent=2))


def _maybe_kill(cfg_dict: dict, step: int, rank: int) -> None:
    """Fault injection for the fault-tolerance test: SIGKILL one worker once, at a given step."""
    spec = cfg_dict.get("_kill_worker")
    if spec and rank == spec["rank"] and step == spec["step"]:
        marker = Path(spec["marker"])
        if not marker.exists():
            marker.write_text(str(step))
            os.kill(os.getpid(), signal.SIGKILL)


def train_loop_per_worker(cfg_dict: dict) -> None:
    import ray.train
    from ray.train import Checkpoint

    cfg = RunConfig.model_validate({k: v for k, v in cfg_dict.items() if not k.startswith("_")})
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(cfg.ray.cpus_per_worker)
    target = load_target(cfg.target.spec, dtype=torch.bfloat16 if cfg.target.dtype == "bfloat16" else torch.float32)
    seqs = read_sequences(cfg.data.regenerated, target.tokenizer, max_seq_len=cfg.data.max_seq_len)
    train_seqs, val_seqs = split_validation(seqs, cfg.data.validation_fraction)
    drafter = build_drafter(cfg, target, train_seqs)
    cache_dir = _abs_path(cfg.data.feature_cache_dir) if cfg.data.feature_cache == "disk" else None
    features = FeatureSource(target, drafter.config.target_layer_ids, cache_dir)
    model = ray.train.torch.prepare_model(
        drafter, parallel_strategy=cfg.ray.strategy if world > 1 else None,
        # Frozen buffers (target embedding, LM head) are identical on every rank: synced once at init,
        # never per forward.
        parallel_strategy_kwargs={"forward_sync_buffers": False} if cfg.ray.strategy == "ddp" else None,
    )
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            drafter.load_state_dict(load_drafter(Path(d) / "drafter", target)[0].state_dict())
            state = torch.load(Path(d) / TRAINER_STATE, weights_only=True)
            optimizer.load_state_dict(state["optimizer"])
            start = state["step"]
    logger = _metric_logger(cfg_dict) if rank == 0 else None
    lengths = [len(s.input_ids) for s in train_seqs]
    per_epoch = max(len(train_seqs) // (cfg.train.seqs_per_step * world), 1)
    gen = torch.Generator().manual_seed(cfg.train.seed * 7919 + rank)
    t_last, tokens, step_last = time.perf_counter(), 0, start
    for step in range(start, cfg.train.max_steps):
        _maybe_kill(cfg_dict, step, rank)
        epoch, i = divmod(step, per_epoch)
        order = batch_order(len(train_seqs), lengths, cfg.train.seqs_per_step, cfg.train.seed, epoch)
        batch = [train_seqs[j] for j in order[(i * world + rank) % len(order)]]
        ids, mask = collate(batch)
        feats = features(batch)
        progress = step / cfg.train.max_steps
        step_cfg = StepConfig(
            anchors_per_seq=cfg.train.anchors_per_seq,
            native_fraction=cfg.train.native_anchor_fraction.at(progress),
            slot_decay=cfg.train.slot_decay,
            support_loss=cfg.train.support_loss,
        )
        lr = lr_at(step, base=cfg.train.lr, warmup=cfg.train.warmup_steps, total=cfg.train.max_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.train.bf16 and not cfg.ray.use_gpu):
            out = drafter_step(model, ids, mask, feats, step_cfg, gen, scout_drafter=drafter)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip).item()
        optimizer.step()
        tokens += int(mask.sum())
        metrics = {**out.metrics, "lr": lr, "grad_norm": grad_norm, "step": step + 1}
        last = step + 1 == cfg.train.max_steps
        if (step + 1) % cfg.train.checkpoint_every == 0 or last:
            now = time.perf_counter()
            metrics["throughput/tokens_per_s"] = tokens * world / (now - t_last)  # response tokens, all workers
            metrics["throughput/samples_per_s"] = (step + 1 - step_last) * cfg.train.seqs_per_step * world / (now - t_last)
            t_last, tokens, step_last = now, 0, step + 1
            if rank == 0 and ((step + 1) % cfg.train.validate_every == 0 or last):
                metrics.update(validate(target, drafter, val_seqs, cfg.train.validation_prompts))
            _report(metrics, rank, drafter, optimizer, step + 1, cfg, Checkpoint)
        if logger is not None:
            logger(metrics, step + 1)


def _report(metrics, rank, drafter, optimizer, step, cfg, Checkpoint) -> None:
    import ray.train

    if rank != 0:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory() as tmp:
        _save(Path(tmp), drafter, optimizer, step, cfg)
        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(tmp))


def _metric_logger(cfg_dict: dict):
    """Log to the job's MLflow run (created by the driver; the same run across worker restarts)."""
    run_id = cfg_dict.get("_mlflow_run_id")
    if not run_id:
        return None
    from pipelines.tracking import TrackedRun, get_client

    run = TrackedRun(get_client(cfg_dict.get("_mlflow_uri")), run_id, experiment_id="", name="")
    return lambda metrics, step: run.log_metrics({k: v for k, v in metrics.items() if k != "step"}, step=step)
