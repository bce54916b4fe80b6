"""The selector stage's Ray Train worker loop (`train.stage: selector`): a head trained alone on cached blocks.

    drelay train --config platform/experiments/smollm2-135m/selector-stage.yaml selector.name=dflash2

1. The block cache (`block_cache.py`) for this frozen drafter + data + anchor settings is built by the
   Train workers themselves, once: each worker drafts the shards i ≡ rank (mod workers) with the
   target and drafter it has already loaded on its device, resuming at the first missing shard.
   Later runs — other heads, other epochs, sweep trials — find the fingerprint and only read it.
2. Each worker reads only its shards (i ≡ rank mod workers) and draws `seqs_per_step ×
   anchors_per_seq` blocks per step from them (a seeded order per epoch and rank), training the
   selector on them
   (`drelay_model.training.selector_step`); with several workers gradients are averaged with one
   all-reduce per parameter.
3. Validation is held-out greedy replay τ, as in a joint run, on `validation_prompts` held-out
   sequences drawn across sources (`worker.spread`); native and oracle τ depend only on the frozen drafter,
   so they are measured once. With `train.early_stop_patience: N`, when `val/tau` has not risen for
   N validations in a row, the run restores the best validated head, cools down (`cooldown.py`:
   every ramp at its end value, the learning rate falling to its floor over `train.cooldown_steps`)
   and exports the cool-down's last head.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from drelay_model.decoding import replay
from drelay_model.training.schedules import lr_at
from drelay_model.training.selector_step import epoch_batches, selector_step_backward
from pipelines.common.paths import repo_path
from pipelines.train import block_cache
from pipelines.train.config import RunConfig
from pipelines.train.cooldown import Cooldown, cooldown_length
from pipelines.train.model_io import restore_training_checkpoint, save_training_checkpoint
from pipelines.train.worker import (
    HEADLINE_METRIC,
    _metric_logger,
    feature_source,
    start_worker,
    step_config,
    train_clock,
    validation_set,
)
from pipelines.train.clock import ProgressLine

STAGE_STATE = "stage_state.pt"


def open_cache(cfg: RunConfig, target, module, train_seqs, device, rank: int, world: int):
    """Build (if needed) and load the block cache → (CachedBlocks, manifest dict)."""
    seqs = block_cache.cache_order(train_seqs, cfg.train.seed)
    lay = block_cache.layout(cfg, repo_path(cfg.data.block_cache_dir), module.drafter, target, seqs)
    if not lay.complete():
        features = feature_source(cfg, target, module)
        module.drafter.eval()
        block_cache.build(lay, seqs, module.drafter, features, cfg, device, rank=rank, world=world)
    manifest = json.loads(lay.manifest.read_text())
    blocks = block_cache.load(lay, with_features=bool(module.selector.capabilities.history_len), rank=rank, world=world)
    return blocks, manifest


class BestHead:
    """Early stopping on `val/tau`: the best value, its weights and the validations since."""

    def __init__(self, patience: int | None) -> None:
        self.patience, self.best, self.state, self.bad, self.step = patience, float("-inf"), None, 0, 0

    def update(self, tau: float, selector, step: int) -> None:
        if tau > self.best:
            self.best, self.bad, self.step = tau, 0, step
            self.state = {k: v.detach().clone() for k, v in selector.state_dict().items()}
        else:
            self.bad += 1

    @property
    def stop(self) -> bool:
        return self.patience is not None and self.bad >= self.patience

    def to_dict(self) -> dict:
        return {"best": self.best, "bad": self.bad, "state": self.state, "step": self.step}

    def load(self, doc: dict) -> None:
        self.best, self.bad, self.state, self.step = doc["best"], doc["bad"], doc["state"], doc["step"]


def selector_stage_loop(cfg_dict: dict) -> None:
    import ray.train

    cfg, rank, world, device, target, train_seqs, val_seqs, module = start_worker(cfg_dict)
    cache, manifest = open_cache(cfg, target, module, train_seqs, device, rank, world)
    selector = module.selector
    params = [p for p in selector.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    clock, best = train_clock(cfg), BestHead(cfg.train.early_stop_patience)
    start, cooldown = _resume(ray.train.get_checkpoint(), module, optimizer, target, clock, best)
    val = validation_set(cfg, target, val_seqs) if rank == 0 else ([], [])
    fixed = _fixed_validation(target, module, *val) if rank == 0 else {}
    logger = _metric_logger(cfg_dict) if rank == 0 else None
    if logger is not None:
        logger({f"cache/{k}": float(manifest[k]) for k in ("blocks", "bytes_per_1000_blocks", "build_seconds")}, start)
    size = cfg.train.seqs_per_step * cfg.train.anchors_per_seq
    per_epoch = max(len(cache) // size, 1)  # each worker's own shards
    line, t_last, step_last = ProgressLine(start, cfg.train.max_steps, clock=cfg.train.budget_clock), time.perf_counter(), start
    autocast = torch.bfloat16 if cfg.train.bf16 else None
    clock.restart()
    for step in range(start, cfg.train.max_steps):
        epoch, i = divmod(step, per_epoch)
        order = epoch_batches(len(cache), size, torch.Generator().manual_seed((cfg.train.seed * 7919 + epoch) * 101 + rank))
        batch = cache.take(order[i % len(order)])
        progress, lr = _schedule(cfg, clock, cooldown, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        out = selector_step_backward(selector, batch, step_config(cfg, progress), autocast_dtype=autocast)
        if world > 1:
            for p in params:
                if p.grad is not None:
                    torch.distributed.all_reduce(p.grad, op=torch.distributed.ReduceOp.AVG)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip).item()
        optimizer.step()
        metrics = {**out.metrics, "loss/total": float(out.loss), "lr": lr, "grad_norm": grad_norm, "step": step + 1}
        clock.tick(world)
        last = step + 1 in (cfg.train.max_steps, cfg.train.stop_at_step) or clock.spent_all(world)
        last = last or (cooldown is not None and cooldown.ends_at(step))
        validating = (step + 1) % cfg.train.validate_every == 0 or last
        if validating:
            started = time.perf_counter()
            with clock.paused():
                if rank == 0:
                    metrics.update(fixed, **_validate_selector(target, module, *val))
                if cooldown is None and _early_stop(best, metrics.get(HEADLINE_METRIC), selector, world, step + 1) and not last:
                    cooldown = _begin_cooldown(cfg, best, selector, clock, step, lr, world)
                    last = cooldown is None
                if last:
                    metrics.update(_export(best, selector, cooldown))
            t_last += time.perf_counter() - started
        checkpointing = (step + 1) % cfg.train.checkpoint_every == 0 or clock.checkpoint_due() or last
        if checkpointing:
            now = time.perf_counter()
            metrics["throughput/blocks_per_s"] = (step + 1 - step_last) * size * world / max(now - t_last, 1e-9)
        if checkpointing or validating:
            state = {**best.to_dict(), "cooldown": None if cooldown is None else cooldown.to_dict()}
            _report(metrics, rank, module, optimizer, step + 1, cfg, state, checkpoint=checkpointing, clock=clock, final=last)
        if checkpointing:
            t_last, step_last = time.perf_counter(), step + 1
            clock.checkpointed()
        if logger is not None:
            logger(metrics, step + 1)
        if rank == 0:
            line.update(step + 1, metrics, budget_left_s=clock.left(), last=last)
        if last:
            break


def _resume(checkpoint, module, optimizer, target, clock, best: BestHead) -> tuple[int, Cooldown | None]:
    """From Ray Train's latest checkpoint (if any): weights, optimizer, the clock's seconds, early
    stopping's best head and a cool-down under way. → (the step to start at, that cool-down)."""
    if checkpoint is None:
        return 0, None
    with checkpoint.as_directory() as d:
        start, clock.spent = restore_training_checkpoint(Path(d), module, optimizer, target)
        if not (Path(d) / STAGE_STATE).is_file():
            return start, None
        state = torch.load(Path(d) / STAGE_STATE, weights_only=True)
    best.load(state)
    return start, Cooldown.from_dict(state.get("cooldown"))


def _schedule(cfg: RunConfig, clock, cooldown: Cooldown | None, step: int) -> tuple[float, float]:
    """(progress, learning rate) at `step`: the run's schedules (steps, or the time budget when that
    binds first), or during a cool-down every ramp at its end (progress 1) and its falling rate."""
    if cooldown is not None:
        return 1.0, cooldown.lr(step, clock.spent, base=cfg.train.lr)
    lr = lr_at(clock.schedule_step(step), base=cfg.train.lr, warmup=cfg.train.warmup_steps, total=cfg.train.max_steps, taken=step)
    return clock.progress(step), lr


def _begin_cooldown(cfg: RunConfig, best: BestHead, selector, clock, step: int, lr: float, world: int) -> Cooldown | None:
    """The stop rule fired after `step` (0-based) at rate `lr`: the cool-down that follows, from the best
    validated head on every rank (rank 0 holds it; one broadcast per tensor with several workers).
    None when it has no steps (`train.cooldown_steps: 0`, or the run's last step is this one)."""
    end = cfg.train.stop_at_step or cfg.train.max_steps
    steps = cooldown_length(cfg.train.cooldown_steps, steps_run=step + 1, steps_left=end - step - 1)
    if steps == 0:
        return None
    if best.state is not None:
        selector.load_state_dict(best.state)
    if world > 1:
        for tensor in selector.state_dict().values():  # views of the parameters and buffers
            torch.distributed.broadcast(tensor, src=0)
    return Cooldown(start=step + 1, steps=steps, lr_start=lr, spent_start=clock.spent, budget_left=clock.left())


def _export(best: BestHead, selector, cooldown: Cooldown | None) -> dict[str, float]:
    """At the run's end: after a cool-down its last head is exported as it is; otherwise the best
    validated head (when one was validated) is loaded for export. → the metrics that say which."""
    if best.state is None:  # no validation on this rank (rank > 0) or none yet
        return {}
    out = {"val/tau_best": best.best, "val/best_step": best.step}
    if cooldown is not None:
        return {**out, "val/stop_step": cooldown.start, "val/cooldown_steps": cooldown.steps}
    selector.load_state_dict(best.state)
    return out


def _fixed_validation(target, module, prompts, conts) -> dict[str, float]:
    """Native and oracle replay τ: fixed by the frozen drafter, measured once."""
    if not prompts:
        return {}
    return {
        "val/tau_native": replay(target, module.drafter, prompts, conts).tau,
        "val/tau_oracle": replay(target, module.drafter, prompts, conts, oracle=True).tau,
    }


def _validate_selector(target, module, prompts, conts) -> dict[str, float]:
    if not prompts:
        return {}
    module.selector.eval()
    tau = replay(target, module.drafter, prompts, conts, selector=module.selector).tau
    module.selector.train()
    return {"val/tau_selector": tau, HEADLINE_METRIC: tau}


def _early_stop(best: BestHead, tau: float | None, selector, world: int, step: int) -> bool:
    """Rank 0 validates; every rank learns whether to stop (one broadcast with several workers)."""
    if tau is not None:
        best.update(tau, selector, step)
    flag = torch.tensor([1.0 if best.stop else 0.0])
    if world > 1:
        torch.distributed.broadcast(flag, src=0)
    return bool(flag.item())


def _report(metrics, rank, module, optimizer, step, cfg, stage_state: dict, *, checkpoint: bool, clock, final: bool) -> None:
    import tempfile

    import ray.train
    from ray.train import Checkpoint

    if rank != 0 or not checkpoint:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory() as tmp:
        save_training_checkpoint(Path(tmp), module, optimizer, step, cfg, train_seconds=clock.spent, final=final)
        torch.save(stage_state, Path(tmp) / STAGE_STATE)  # early stopping's best head and any cool-down under way
        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(tmp))
