"""A long run that survives a fresh machine: the weights in the repository, not only in outputs/.

Ray Train's checkpoints (outputs/ray/<run>) hold the optimizer's moments too, float32, ~3× the
weights; they live on the machine that trained and are lost with it. With `train.snapshot_dir`,
every checkpoint also leaves the trainable weights alone, in bfloat16 (the drafter, 8M parameters:
16 MB; with a selector, its tensors beside them under `selector.*`), with the step and the budget
spent in the meta: an ordinary drafter checkpoint (`load_drafter` casts it back to float32), which
`drelay snapshot carry` commits into git history at a stop (pipelines/train/snapshot_history.py).

Rerunning the same command finds Ray's checkpoint when there is one (exact: weights, moments,
step). Where there is none, it continues from the snapshot: its weights, its step (which fixes the
data position: batch order is a function of seed and epoch) and its budget spent, with a fresh
AdamW whose rate is re-warmed over `train.warmup_steps` steps (new moments on trained weights, as
when a run continues a checkpoint). Rounding to bfloat16 moves each weight by at most 2⁻⁹ of itself.
"""

from __future__ import annotations

from pathlib import Path

import torch

from drelay_model.drafter import load_drafter, save_drafter
from drelay_model.drafter.checkpoint import CONFIG
from drelay_model.errors import DRelayError
from drelay_model.training.step import DraftTrainModule
from pipelines.train.model_io import saved_selector, selector_tensors

SNAPSHOT_DTYPE = torch.bfloat16


def save_snapshot(
    path: Path, module: DraftTrainModule, *, step: int, train_seconds: float, run_name: str, selector: dict | None
) -> None:
    """Write the module's weights to `path` in bfloat16 (atomically: a stop mid-write keeps the last one)."""
    extra = selector_tensors(module)
    meta = {"step": step, "train_seconds": round(float(train_seconds), 1), "run_name": run_name, "selector": selector,
            "snapshot": True}  # fmt: skip
    save_drafter(module.drafter, path, extra_tensors=extra, meta=meta, dtype=SNAPSHOT_DTYPE)


def has_snapshot(path: Path) -> bool:
    return (path / CONFIG).is_file()


def check_snapshot(path: Path, *, run_name: str) -> None:
    """Before any cluster starts: a snapshot already in `path` must be readable and this run's."""
    if not has_snapshot(path):
        return
    from drelay_model.drafter.checkpoint import read_checkpoint

    try:
        meta = read_checkpoint(path)[2]
    except DRelayError as exc:
        raise DRelayError(f"train.snapshot_dir: {exc}") from None
    _check_owner(path, meta, run_name)


def is_snapshot_of(meta: dict, run_name: str | None) -> bool:
    """A checkpoint's meta is a training snapshot of run `run_name` (of any run when None)."""
    return bool(meta.get("snapshot")) and run_name in (None, meta.get("run_name"))


def _check_owner(path: Path, meta: dict, run_name: str) -> None:
    if not is_snapshot_of(meta, run_name):
        raise DRelayError(
            f"train.snapshot_dir: '{path}' holds a snapshot of run {meta.get('run_name')!r}, not of ray.run_name={run_name!r}"
        )


def restore_snapshot(path: Path, module: DraftTrainModule, target, *, run_name: str) -> tuple[int, float]:
    """Load a snapshot's weights into `module` in place → (its step, the training seconds spent).
    A snapshot of another run, or of another shape, is a one-line error naming train.snapshot_dir."""
    where = f"train.snapshot_dir: '{path}'"
    try:
        drafter, extra, meta = load_drafter(path, target)
    except DRelayError as exc:
        raise DRelayError(f"{where}: {exc}") from None
    _check_owner(path, meta, run_name)
    own = module.drafter.state_dict()
    if {k: tuple(v.shape) for k, v in drafter.state_dict().items()} != {k: tuple(v.shape) for k, v in own.items()}:
        raise DRelayError(f"{where}: its drafter has another shape than the configured one")
    module.drafter.load_state_dict(drafter.state_dict())
    if module.selector is not None:
        tensors = saved_selector(extra)
        if not tensors:
            raise DRelayError(f"{where} holds no selector weights, and this run trains a selector")
        module.selector.load_state_dict(tensors)
    return int(meta["step"]), float(meta.get("train_seconds", 0.0))


def rewarm(lr: float, *, step: int, resumed_at: int | None, warmup: int) -> float:
    """The rate after a resume with a fresh optimizer: linear over `warmup` steps from the resume."""
    if resumed_at is None or warmup <= 0:
        return lr
    return lr * min(1.0, (step - resumed_at + 1) / warmup)
