"""The Ray Train worker loop: one process per worker, DDP over gloo (CPU) or NCCL (GPU).

Per step: the frozen target computes context features for a batch of sequences (no grad), the
drafter (and selector, jointly, Eq. 4) trains on anchor blocks — uniform + scout-traced — and the
optimizer steps. Rank 0 logs metrics to the job's MLflow run, validates with greedy replay τ and
writes checkpoints; every rank reports to Ray Train at the same cadence. A restarted worker group
resumes from the latest checkpoint: weights, optimizer, step (which fixes the data position, since
batch order is a function of seed and epoch).
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

from drelay_model.decoding import GenerationConfig, SpeculativeEngine, replay
from drelay_model.training.step import StepConfig, training_step_backward
from drelay_model.training.losses import LossSwitches
from drelay_model.target import load_target
from drelay_model.kernels.cpu_linear import bf16_native
from drelay_model.training.schedules import lr_at
from pipelines.common.replay_counts import ReplayCounts
from pipelines.common.paths import repo_path
from pipelines.train.clock import ProgressLine, TrainClock
from drelay_model.diagnostics import diagnose_rounds, pad_rounds
from pipelines.train.config import RunConfig
from pipelines.train.data import batch_order, collate, read_sequences, reference_sequences, split_validation
from pipelines.train.features import FeatureSource
from pipelines.train.held_out import HeldOutBlocks, held_out_blocks, teacher_forced_metrics
from pipelines.train.model_io import build_module, restore_training_checkpoint, save_training_checkpoint, selector_meta
from pipelines.train.snapshot import has_snapshot, restore_snapshot, rewarm, save_snapshot


def load_data(cfg: RunConfig, target):
    """(train, validation) sequences: regenerated responses, or the reference-answer fallback."""
    if cfg.data.fallback_reference_answers:
        from pipelines.data.corpora import load_training_corpus

        seqs = reference_sequences(load_training_corpus(cfg.data.sources), target.tokenizer, max_seq_len=cfg.data.max_seq_len)
    else:
        seqs = read_sequences(cfg.data.regenerated, target.tokenizer, max_seq_len=cfg.data.max_seq_len)
    return split_validation(seqs, cfg.data.validation_fraction)


def spread(val_seqs: list, seed: int) -> list:
    """The held-out sequences in a seeded random order, so the first `validation_prompts` sample every
    source (in file order they are the first source's, which can repeat training answers verbatim)."""
    from pipelines.train.block_cache import cache_order

    return cache_order(val_seqs, seed + 1)


def validation_set(cfg: RunConfig, target, val_seqs) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts and the target's greedy continuations for replay (regenerated data already holds
    them; reference answers do not, so the fallback decodes them once), of the first
    `validation_prompts` held-out sequences in a seeded random order (`spread`)."""
    seqs = spread(val_seqs, cfg.train.seed)[: cfg.train.validation_prompts]
    prompts = [list(s.input_ids[: s.response_start]) for s in seqs]
    if not cfg.data.fallback_reference_answers:
        return prompts, [list(s.input_ids[s.response_start :]) for s in seqs]
    conts = [SpeculativeEngine(target).generate([p], GenerationConfig(max_new_tokens=128)).tokens[0] for p in prompts]
    return prompts, conts


# The headline metric, one name for every run (sweeps rank trials by it): held-out greedy replay τ
# with the run's own selector — `val/tau_selector` when it trains one, else `val/tau_native`.
HEADLINE_METRIC = "val/tau"


def feature_source(cfg: RunConfig, target, module) -> FeatureSource:
    """The target's features (and top-k with soft labels) for `module`'s drafter: from the disk
    cache when `data.feature_cache: disk`, else computed per batch."""
    cache_dir = repo_path(cfg.data.feature_cache_dir) if cfg.data.feature_cache == "disk" else None
    layers = module.drafter.config.target_layer_ids
    return FeatureSource(target, layers, cache_dir, bf16=cfg.train.bf16, soft_k=cfg.train.soft_labels)


def held_out_set(cfg: RunConfig, val_seqs, features: FeatureSource) -> HeldOutBlocks | None:
    """The teacher-forced held-out blocks of the validation conversations (`held_out.py`), or None
    where the labels are not the target's own tokens (reference answers instead of regenerated data)."""
    if cfg.data.fallback_reference_answers:
        return None
    return held_out_blocks(spread(val_seqs, cfg.train.seed)[: cfg.train.validation_prompts], features)


def validate(target, module, prompts, conts, held: HeldOutBlocks | None = None) -> dict[str, float]:
    """Greedy replay τ of the native path, the pool's oracle, (if any) the trained selector, and the
    headline `val/tau` with its 95% interval over the validation prompts (`val/tau_ci_low`,
    `val/tau_ci_high`: a bootstrap of Σ committed ÷ Σ rounds resampling the prompts); on the native
    path, the pool's coverage at the first error and the one-edit gain (`drelay_model/diagnostics.py`):
    how much a selector could repair; with a selector, `val/repair_gain` = τ(selector) ÷ τ(native) and
    its interval, paired by prompt (both replays read the same prompts). With `held`, also the teacher-forced held-out metrics
    (`held_out.py`: fixed blocks, far less noisy than replay τ between close checkpoints)."""
    if not prompts:
        return {}
    module.eval()
    trace, native_counts = [], ReplayCounts(len(prompts))

    def native_round(r) -> None:
        trace.append((r.block.cand_ids[0], r.path, r.ref))
        native_counts.add(r)

    native = replay(target, module.drafter, prompts, conts, on_round=native_round)
    diag = diagnose_rounds(*pad_rounds(trace)) if trace else None
    out = {
        "val/tau_native": native.tau,
        "val/tau_oracle": replay(target, module.drafter, prompts, conts, oracle=True).tau,
    }
    if diag is not None:
        out.update({"val/coverage_first_error": diag.coverage_first_error, "val/one_edit_gain": diag.one_edit_gain})
    headline_counts = native_counts
    if module.selector is not None:
        headline_counts = ReplayCounts(len(prompts))
        out["val/tau_selector"] = replay(target, module.drafter, prompts, conts, selector=module.selector,
                                         on_round=headline_counts.add).tau  # fmt: skip
        # The repair alone (the paper's Table 4): τ(selector) ÷ τ(the same drafter's argmax path), paired by prompt.
        out.update(headline_counts.tau_ratio(native_counts).as_dict("val/repair_gain"))
    out[HEADLINE_METRIC] = out.get("val/tau_selector", out["val/tau_native"])
    iv = headline_counts.tau_interval()
    out[f"{HEADLINE_METRIC}_ci_low"], out[f"{HEADLINE_METRIC}_ci_high"] = iv.low, iv.high
    if held is not None:
        out.update(teacher_forced_metrics(module, held))
    module.train()
    return out


def train_clock(cfg: RunConfig) -> TrainClock:
    """The run's clock: its budget (`train.max_minutes` on `train.budget_clock`) and wall-time
    checkpoint cadence (`train.checkpoint_minutes`)."""
    t = cfg.train
    return TrainClock(t.max_minutes, t.max_steps, kind=t.budget_clock, checkpoint_minutes=t.checkpoint_minutes)


def step_config(cfg: RunConfig, progress: float) -> StepConfig:
    """The training step's settings at `progress` ∈ [0, 1] of the run (schedules evaluated there)."""
    t = cfg.train
    return StepConfig(
        anchors_per_seq=t.anchors_per_seq,
        native_fraction=t.native_anchor_fraction.at(progress),
        slot_decay=t.slot_decay,
        scout_policy=t.scout_policy,
        scout_restart=t.scout_restart,
        alpha=t.selector_alpha.at(progress),
        beta=t.credit_blend.at(progress),
        credit_floor=t.credit_floor,
        credit_cap=t.credit_cap,
        progress=progress,
        switches=LossSwitches(support=t.support_loss, selector=t.selector_loss, credit=not t.uniform_repair_weights),
        micro_batches=t.micro_batches,
        chunk_tokens=t.chunk_tokens,
        partial_blocks=t.partial_blocks,
    )


def worker_device(cfg: RunConfig) -> torch.device:
    """Ray Train's device for this worker (its GPU with ray.use_gpu), unless target.device says cpu."""
    import ray.train.torch

    if cfg.target.device == "cpu" or not cfg.ray.use_gpu:
        return torch.device("cpu")
    return ray.train.torch.get_device()


def _maybe_kill(cfg_dict: dict, step: int, rank: int) -> None:
    """Fault injection for the fault-tolerance test: SIGKILL one worker once, at a given step."""
    spec = cfg_dict.get("_kill_worker")
    if spec and rank == spec["rank"] and step == spec["step"]:
        marker = Path(spec["marker"])
        if not marker.exists():
            marker.write_text(str(step))
            os.kill(os.getpid(), signal.SIGKILL)


def _labels(target, ids: torch.Tensor) -> torch.Tensor:
    """Teacher-forced target argmax: label_ids[p] = argmax p(· | ids[:p]) (reference-answer fallback)."""
    logits = target(ids, target.new_cache(ids.shape[0], ids.shape[1])).logits  # [B, N, V]
    return torch.cat([ids[:, :1], logits[:, :-1].argmax(-1)], dim=1)


def training_precision(cfg: RunConfig, device: torch.device, *, announce: bool = False) -> RunConfig:
    """`train.bf16` as this worker can run it. On a CPU without native bfloat16 matrix units (no
    AVX512-BF16 / AMX: oneDNN's check, `cpu_linear.bf16_native`) ATen multiplies bfloat16 matrices
    in a scalar loop, measured here at 0.1 GFLOP/s against 6 for float32 — a step ~40× slower — so
    such a worker trains in float32 and says so once."""
    if not cfg.train.bf16 or device.type != "cpu" or bf16_native():
        return cfg
    if announce:
        print(
            "[train] this CPU has no native bfloat16 matrix units: training in float32 (train.bf16 ignored)",
            file=sys.__stdout__,
            flush=True,
        )
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"bf16": False})})


def start_worker(cfg_dict: dict):
    """What every training loop starts from, on this Train worker: the validated config, rank and
    world size, the device, the frozen target, the train/validation split and the module on the
    device. Returns (cfg, rank, world, device, target, train_seqs, val_seqs, module)."""
    import ray.train

    cfg = RunConfig.model_validate({k: v for k, v in cfg_dict.items() if not k.startswith("_")})
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(cfg.ray.cpus_per_worker)
    device = worker_device(cfg)
    cfg = training_precision(cfg, device, announce=rank == 0)
    target = load_target(cfg.target.spec, device=device, dtype=cfg.target.dtype)
    train_seqs, val_seqs = load_data(cfg, target)
    module = build_module(cfg, target, train_seqs).to(device)
    return cfg, rank, world, device, target, train_seqs, val_seqs, module


def param_groups(module, drafter_lr_scale: float) -> list[dict]:
    """AdamW's parameter groups: one (every trainable parameter at the run's rate), or with a drafter
    rate scale ≠ 1 two: the drafter's at lr × scale (`lr_scale`), the rest (the selector) at lr. Scale 1
    keeps one group, so a single-group checkpoint's optimizer state loads."""
    params = [p for p in module.parameters() if p.requires_grad]
    if drafter_lr_scale == 1.0:
        return [{"params": params, "lr_scale": 1.0}]
    mine = {id(p) for p in module.drafter.parameters()}
    groups = [{"params": [p for p in params if id(p) in mine], "lr_scale": drafter_lr_scale},
              {"params": [p for p in params if id(p) not in mine], "lr_scale": 1.0}]  # fmt: skip
    return [g for g in groups if g["params"]]


def train_loop_per_worker(cfg_dict: dict) -> None:
    import ray.train

    cfg, rank, world, device, target, train_seqs, val_seqs, module = start_worker(cfg_dict)
    autocast = cfg.train.bf16  # bfloat16 autocast on CPU and CUDA alike: the feature forward and the step
    features = feature_source(cfg, target, module)
    model = ray.train.torch.prepare_model(
        module,
        parallel_strategy=cfg.ray.strategy if world > 1 else None,
        # Frozen buffers (target embedding, LM head) are identical on every rank: synced once at
        # init, never per forward.
        parallel_strategy_kwargs={"forward_sync_buffers": False} if cfg.ray.strategy == "ddp" else None,
    )
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(param_groups(module, cfg.train.drafter_lr_scale), lr=cfg.train.lr,
                                  weight_decay=cfg.train.weight_decay)  # fmt: skip
    start, clock = 0, train_clock(cfg)
    checkpoint, resumed_at = ray.train.get_checkpoint(), None  # resumed_at: a fresh optimizer's re-warm-up starts there
    snapshot = Path(repo_path(cfg.train.snapshot_dir)) if cfg.train.snapshot_dir else None
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            start, clock.spent = restore_training_checkpoint(Path(d), module, optimizer, target)
    elif snapshot is not None and has_snapshot(snapshot):  # no Ray checkpoint here (a fresh machine)
        start, clock.spent = restore_snapshot(snapshot, module, target, run_name=cfg.ray.run_name)
        resumed_at = start
        if rank == 0:
            print(f"[train] no Ray checkpoint: continuing from the snapshot in {snapshot} at step {start}"
                  f" ({clock.spent / 60:.1f} budget minutes spent), optimizer re-warmed", file=sys.stderr)  # fmt: skip
    val = validation_set(cfg, target, val_seqs) if rank == 0 else ([], [])
    held = held_out_set(cfg, val_seqs, features) if rank == 0 else None
    logger = _metric_logger(cfg_dict) if rank == 0 else None
    lengths = [len(s.input_ids) for s in train_seqs]
    per_epoch = max(len(train_seqs) // (cfg.train.seqs_per_step * world), 1)
    gen = torch.Generator().manual_seed(cfg.train.seed * 7919 + rank)
    t_last, tokens, step_last = time.perf_counter(), 0, start
    line = ProgressLine(start, cfg.train.max_steps, clock=cfg.train.budget_clock)
    if start == 0 and cfg.drafter.init_checkpoint and logger is not None:
        # The starting point of a continued drafter, at step 0 and 0 budget minutes (before the clock starts).
        logger({**validate(target, module, *val, held), "train/budget_minutes": 0.0}, 0)
    clock.restart()
    for step in range(start, cfg.train.max_steps):
        _maybe_kill(cfg_dict, step, rank)
        epoch, i = divmod(step, per_epoch)
        order = batch_order(len(train_seqs), lengths, cfg.train.seqs_per_step, cfg.train.seed, epoch)
        batch = [train_seqs[j] for j in order[(i * world + rank) % len(order)]]
        ids, mask = (t.to(device) for t in collate(batch))
        labels = _labels(target, ids) if cfg.data.fallback_reference_answers else None
        got = features.batch(batch)  # context features (and the target's top-k with soft labels)
        feats, soft = got.features.to(device), (got.soft.to(device) if got.soft is not None else None)
        progress = clock.progress(step)  # steps, or the time budget when that binds first
        lr = lr_at(
            clock.schedule_step(step), base=cfg.train.lr, warmup=cfg.train.warmup_steps, total=cfg.train.max_steps, taken=step
        )
        lr = rewarm(lr, step=step, resumed_at=resumed_at, warmup=cfg.train.warmup_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        optimizer.zero_grad(set_to_none=True)
        out = training_step_backward(
            model,
            module,
            ids,
            mask,
            feats,
            step_config(cfg, progress),
            gen,
            label_ids=labels,
            soft=soft,
            autocast_dtype=torch.bfloat16 if autocast else None,
        )
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip).item()
        optimizer.step()
        tokens += int(mask.sum())
        clock.tick(world)
        metrics = {**out.metrics, "lr": lr, "grad_norm": grad_norm, "step": step + 1, "train/budget_minutes": clock.spent / 60}
        last = step + 1 == cfg.train.max_steps or clock.spent_all(world)
        validating = (step + 1) % cfg.train.validate_every == 0 or last  # its own schedule, not only at checkpoints
        if rank == 0 and validating:
            started = time.perf_counter()
            with clock.paused():  # replay time is not training budget
                metrics.update(validate(target, module, *val, held))
            t_last += time.perf_counter() - started  # nor training throughput
        checkpointing = (step + 1) % cfg.train.checkpoint_every == 0 or clock.checkpoint_due() or last
        if checkpointing:
            now = time.perf_counter()
            metrics["throughput/tokens_per_s"] = tokens * world / (now - t_last)  # response tokens, all workers
            metrics["throughput/samples_per_s"] = (step + 1 - step_last) * cfg.train.seqs_per_step * world / (now - t_last)
        if checkpointing or validating:  # every rank reports at the same steps (Ray's report is a barrier)
            _report(
                metrics, rank, module, optimizer, step + 1, cfg, checkpoint=checkpointing, train_seconds=clock.spent, final=last
            )
        if checkpointing:
            t_last, tokens, step_last = time.perf_counter(), 0, step + 1
            clock.checkpointed()
        if logger is not None:
            logger(metrics, step + 1)
        if rank == 0:
            line.update(step + 1, metrics, budget_left_s=clock.left(), last=last)
        if last:
            break


def _report(
    metrics, rank, module, optimizer, step, cfg, *, checkpoint: bool, train_seconds: float = 0.0, final: bool = False
) -> None:
    """Report to Ray Train (and through a TuneReportCallback to Tune): at validation steps so a
    scheduler sees `val/tau` as it comes, with rank 0's checkpoint at checkpoint steps."""
    import ray.train
    from ray.train import Checkpoint

    if rank != 0 or not checkpoint:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory() as tmp:
        save_training_checkpoint(Path(tmp), module, optimizer, step, cfg, train_seconds=train_seconds, final=final)
        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(tmp))
    if cfg.train.snapshot_dir:
        save_snapshot(Path(repo_path(cfg.train.snapshot_dir)), module, step=step, train_seconds=train_seconds,
                      run_name=cfg.ray.run_name, selector=selector_meta(module, cfg))  # fmt: skip


def _metric_logger(cfg_dict: dict):
    """Log to the job's MLflow run (created by the driver; the same run across worker restarts)."""
    run_id = cfg_dict.get("_mlflow_run_id")
    if not run_id:
        return None
    from pipelines.common.tracking import TrackedRun, get_client

    import ray.train

    from pipelines.common.run_tags import HARDWARE, worker_hardware

    run = TrackedRun(get_client(cfg_dict.get("_mlflow_uri")), run_id, experiment_id="", name="")
    run.set_tags({HARDWARE: worker_hardware(ray.train.get_context().get_world_size())})  # the workers', not the driver's
    return lambda metrics, step: run.log_metrics({k: v for k, v in metrics.items() if k != "step"}, step=step)
