"""Build the trainable module (drafter + optional selector) and save/restore training checkpoints."""

from __future__ import annotations

from pathlib import Path

import torch

from drelay_model.drafter import BlockDrafter, DrafterConfig, build_draft_vocab, load_drafter, save_drafter
from drelay_model.errors import DRelayError
from drelay_model.training.step import DraftTrainModule
from drelay_model.selectors import default_registry
from pipelines.train.config import RunConfig
from pipelines.train.data import label_counts

TRAINER_STATE = "trainer_state.pt"


def build_module(cfg: RunConfig, target, train_seqs) -> DraftTrainModule:
    """Drafter (fresh, or from `drafter.init_checkpoint`) and the configured selector, seeded so that
    every worker starts from identical weights."""
    d = cfg.drafter
    torch.manual_seed(cfg.train.seed)
    extra, meta = {}, {}  # what init_checkpoint holds beyond the drafter (e.g. a trained selector)
    if d.init_checkpoint:
        drafter, extra, meta = load_drafter(d.init_checkpoint, target)
        if d.grow_layers:
            drafter.grow(d.grow_layers)  # new layers start as the identity: the same drafts at step 0
        drafter.train()
    else:
        overrides = dict(num_layers=d.num_layers, block_size=d.block_size, top_k=d.top_k, draft_vocab_size=d.draft_vocab_size)
        if d.target_layer_ids is not None:
            overrides["target_layer_ids"] = tuple(d.target_layer_ids)
        if d.intermediate_size is not None:
            overrides["intermediate_size"] = d.intermediate_size
        mapping = None
        if d.draft_vocab_size is not None:
            counts = label_counts(train_seqs, target.vocab_size)
            mapping = build_draft_vocab(counts, d.draft_vocab_size, always=target.eos_token_ids)
        drafter = BlockDrafter(DrafterConfig.for_target(target, **overrides), target, draft_to_target=mapping)
    if d.freeze:  # a fixed backbone: only the selector trains (the selector-head study)
        drafter.requires_grad_(False)
    selector = None
    if cfg.selector.trains_selector:
        if not cfg.selector.fresh and continues_selector(cfg, meta):
            # Continue training the checkpoint's own selector (e.g. a longer joint run).
            selector = default_registry().from_checkpoint(cfg.selector.name, drafter=drafter, tensors=extra, meta=meta).train()
        else:
            selector = default_registry().create(cfg.selector.name, drafter=drafter, config=cfg.selector.config or None)
        if not cfg.train.selector_loss:
            # "No selector loss" (Table 4): nothing trains the selector, so it stays at its
            # initialisation, which picks exactly the native path. Frozen, DDP does not wait for
            # gradients it will never get.
            selector.requires_grad_(False)
    return DraftTrainModule(drafter, selector)


def continues_selector(cfg: RunConfig, meta: dict) -> bool:
    """Does `drafter.init_checkpoint` (whose meta is `meta`) hold a trained selector of the configured
    kind? Then training continues from its weights, under its saved selector config; an explicit
    `selector.config` that differs from that is an error, since the weights belong to the saved one."""
    saved = meta.get("selector") or {}
    if cfg.selector.fresh or not cfg.selector.trains_selector or saved.get("name") != cfg.selector.name:
        return False  # `selector.fresh`: the saved selector is ignored, so its config binds nothing
    kept = default_registry().factory(cfg.selector.name).saved_config(saved.get("config")) or {}
    diff = sorted(k for k, v in cfg.selector.config.items() if k not in kept or kept[k] != v)
    if diff:
        raise DRelayError(
            f"selector.config: {', '.join(diff)} differs from the trained '{cfg.selector.name}' selector in "
            "drafter.init_checkpoint; drop it to continue training that selector"
        )
    return True


def selector_meta(module: DraftTrainModule, cfg: RunConfig) -> dict | None:
    if module.selector is None:
        return None
    return {"name": cfg.selector.name, "config": getattr(module.selector, "config").to_dict()}


SELECTOR_PREFIX = "selector."  # a checkpoint keeps the trained selector's tensors beside the drafter's


def selector_tensors(module: DraftTrainModule) -> dict[str, torch.Tensor] | None:
    """The module's selector tensors under `SELECTOR_PREFIX` (a drafter checkpoint's extra tensors), or None."""
    if module.selector is None:
        return None
    return {f"{SELECTOR_PREFIX}{k}": v for k, v in module.selector.state_dict().items()}


def saved_selector(extra: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's extra tensors → the selector's state dict (empty when it holds none)."""
    return {k.removeprefix(SELECTOR_PREFIX): v for k, v in extra.items() if k.startswith(SELECTOR_PREFIX)}


def save_training_checkpoint(
    path: Path, module: DraftTrainModule, optimizer, step: int, cfg: RunConfig, *, train_seconds: float = 0.0, final: bool = False
) -> None:
    """drafter/ (a drafter checkpoint that also holds the selector as selector.*), optimizer, step and
    the seconds of training spent so far (what `train.max_minutes` counts); `final` marks the run's
    last checkpoint (max_steps reached or the time budget spent) in the drafter's meta."""
    extra = selector_tensors(module)
    meta = {"step": step, "run_name": cfg.ray.run_name, "selector": selector_meta(module, cfg),
            "train_seconds": round(float(train_seconds), 1), "final": final}  # fmt: skip
    save_drafter(module.drafter, path / "drafter", extra_tensors=extra, meta=meta)
    torch.save({"optimizer": optimizer.state_dict(), "step": step, "train_seconds": float(train_seconds)}, path / TRAINER_STATE)
    (path / "run_config.json").write_text(cfg.model_dump_json(indent=2))


def restore_training_checkpoint(path: Path, module: DraftTrainModule, optimizer, target) -> tuple[int, float]:
    """Load weights and optimizer state in place; returns (the step to continue from, the seconds of
    training already spent: 0 for checkpoints that predate the count)."""
    drafter, extra, _ = load_drafter(path / "drafter", target)
    module.drafter.load_state_dict(drafter.state_dict())
    if module.selector is not None:
        module.selector.load_state_dict(saved_selector(extra))
    state = torch.load(path / TRAINER_STATE, weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"]), float(state.get("train_seconds", 0.0))
