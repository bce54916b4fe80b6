"""Run configs: strict pydantic models loaded from YAML with dotted overrides.

    drelay train --config platform/experiments/smollm2-135m/train.yaml train.max_steps=200 ray.num_workers=1

Every model forbids unknown keys and range-checks its values, so a typo or a bad value is a one-line
error naming the field (`train.lr: Input should be greater than 0`), never a silent default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, field_validator, model_validator

from drelay_model.errors import DRelayError
from pipelines.common.config_base import StrictConfig, validate_config
from pipelines.common.methods import NATIVE, training_selector
from pipelines.common.yaml_file import read_mapping


class TargetSection(StrictConfig):
    spec: str = "smollm2-135m"
    dtype: Literal["float32", "bfloat16"] = "float32"
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: each worker's Ray Train device (CUDA with ray.use_gpu)


class DrafterSection(StrictConfig):
    num_layers: int = Field(2, ge=1, le=64)
    target_layer_ids: tuple[int, ...] | None = None  # default: early, middle and late layers
    intermediate_size: int | None = Field(None, ge=1)
    block_size: int = Field(16, ge=2, le=64)
    top_k: int = Field(16, ge=1, le=256)
    draft_vocab_size: int | None = Field(None, ge=16)
    init_checkpoint: str | None = None  # start from a trained drafter
    freeze: bool = False  # keep the drafter (backbone) fixed: train only the selector (needs init_checkpoint)
    grow_layers: int = Field(0, ge=0, le=8)  # identity layers appended to init_checkpoint's drafter (depth growth)


class SelectorSection(StrictConfig):
    """`native`: train the drafter alone; else a trainable registered selector, trained jointly."""

    name: str = NATIVE
    config: dict[str, Any] = Field(default_factory=dict)
    fresh: bool = False  # start from the selector's initialisation even if drafter.init_checkpoint holds one

    @field_validator("name")
    @classmethod
    def _registered(cls, name: str) -> str:
        return training_selector(name)  # checked against the registry; legacy 'none' → 'native'

    @property
    def trains_selector(self) -> bool:
        return self.name != NATIVE


class DataSection(StrictConfig):
    regenerated: str = "data/regenerated/smollm2-135m*.jsonl"  # a file or a glob (parallel shards)
    fallback_reference_answers: bool = False  # teacher-forced argmax over reference answers (weaker)
    sources: tuple[str, ...] = ("gsm8k_train", "alpaca5k", "mbpp_train", "fastchat")
    max_seq_len: int = Field(768, ge=32, le=32768)
    validation_fraction: float = Field(0.02, ge=0.0, lt=0.5)
    feature_cache: Literal["none", "disk"] = "none"
    feature_cache_dir: str = "outputs/feature_cache"
    # The selector stage's block cache (`train.stage: selector`): one folder per fingerprint of
    # drafter + data + anchor settings under this directory; `block_cache_sequences` training
    # sequences go into it (None: all of them), `block_cache_shard` sequences per shard.
    block_cache_dir: str = "outputs/block_cache"
    block_cache_sequences: int | None = Field(None, ge=1)
    block_cache_shard: int = Field(32, ge=1, le=4096)


class Schedule(StrictConfig):
    """A value ramped linearly from `start` to `end` over the first `ramp_fraction` ∈ (0, 1] of
    training (the ramp divides progress, so it must be > 0). Start and end must be finite."""

    start: float = Field(allow_inf_nan=False)
    end: float = Field(allow_inf_nan=False)
    ramp_fraction: float = Field(1.0, gt=0.0, le=1.0)

    def at(self, progress: float) -> float:
        t = min(max(progress / self.ramp_fraction, 0.0), 1.0)
        return self.start + (self.end - self.start) * t


class FractionSchedule(Schedule):
    """A schedule of a fraction or a blend weight: start and end in [0, 1]."""

    start: float = Field(ge=0.0, le=1.0)
    end: float = Field(ge=0.0, le=1.0)


class CoefficientSchedule(Schedule):
    """A schedule of a loss coefficient: start and end ≥ 0 (finite)."""

    start: float = Field(ge=0.0, allow_inf_nan=False)
    end: float = Field(ge=0.0, allow_inf_nan=False)


class TrainSection(StrictConfig):
    # joint: drafter (+ selector) steps on fresh target features and drafter forwards; selector:
    # only the head trains, on blocks the frozen drafter drafted once into the block cache
    # (pipelines/train/block_cache.py; needs drafter.freeze and train.scout_policy: native).
    stage: Literal["joint", "selector"] = "joint"
    max_steps: int = Field(2000, ge=1)
    seqs_per_step: int = Field(4, ge=1)  # per worker
    anchors_per_seq: int = Field(16, ge=1, le=512)
    lr: float = Field(6e-4, gt=0.0, le=1.0)
    # The drafter's rate as a share of train.lr (joint runs: a fresh selector learns at lr while a
    # trained drafter continues at lr × scale; restarting a trained drafter at a fresh head's rate first
    # undoes its training, docs/training.md). 1: one rate for every trainable parameter.
    drafter_lr_scale: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    warmup_steps: int = Field(50, ge=0)
    weight_decay: float = Field(0.0, ge=0.0)
    grad_clip: float = Field(1.0, gt=0.0)
    # Support weight of slot i: None = uniform, Eq. 4 as written (the paper); a float d = DFlash's
    # exp(-(i-1)/d), which tilts Eq. 4 towards the selector term and weakens late-slot coverage.
    slot_decay: float | None = Field(None, gt=0.0)
    # Support term's target: None = the target's greedy token (hard labels, Eq. 4 as written); k = the
    # target's own distribution restricted to its top k (1 ≤ k ≤ 64) and renormalised over the ids the
    # draft vocabulary holds, taken from the feature forward and cached beside the features
    # (drelay_model/training/losses.py `soft_support_targets`).
    soft_labels: int | None = Field(None, ge=1, le=64)
    # The share of anchor blocks drafted as partial blocks of a random length L ∈ 1..H−1, as a
    # cost-aware round drafts them (`BlockDrafter.draft(slots=L)`), supervised on those L slots only.
    partial_blocks: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    native_anchor_fraction: FractionSchedule = FractionSchedule(start=0.3, end=0.5)  # share of native anchors
    # The scout's path under teacher prefixes: "selector" (the selector's own teacher-forced Eq. 2
    # choices: the prefix it follows is the one incremental selection writes, so "the scout and
    # incremental native selection see the same earlier tokens"; a run without a selector, or with
    # one that has no teacher-forced path, follows the argmax) or "native" (always the argmax path).
    scout_policy: Literal["native", "selector"] = "selector"
    scout_restart: bool = True  # a chain that leaves the response restarts, so the fraction is realised
    # α_t of Eq. 4 ramps 0.05 → 1 over the first 30% of training, then trains at 1 (§5: "increases … to 1").
    selector_alpha: CoefficientSchedule = CoefficientSchedule(start=0.05, end=1.0, ramp_fraction=0.3)
    credit_blend: FractionSchedule = FractionSchedule(start=0.0, end=1.0, ramp_fraction=0.5)  # β_t
    credit_cap: float = Field(4.0, ge=1.0, allow_inf_nan=False)
    credit_floor: float = Field(0.1, gt=0.0, le=1.0)  # the credit normalisation divides by it
    support_loss: bool = True
    selector_loss: bool = True
    uniform_repair_weights: bool = False
    bf16: bool = True
    seed: int = 0
    # A wall-clock budget for the training steps (validation excluded), in minutes: the run ends at
    # max_steps or when the budget is spent, whichever comes first, and every schedule (lr, α, β,
    # native-anchor share) follows the larger of the two progress fractions. None: steps only.
    # Counted per attempt: a resumed run gets the budget left at its checkpoint (saved with it).
    max_minutes: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    # What a budget minute is: "wall" (elapsed) or "cpu" (the worker process's CPU time: equal work
    # on a shared machine, what a budget study compares; pipelines/train/clock.py).
    budget_clock: Literal["wall", "cpu"] = "wall"
    # Also checkpoint every this many wall minutes (None: only every checkpoint_every steps), so a
    # stop loses at most that much of a long run.
    checkpoint_minutes: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    # A folder (in the repository, so that it can be committed) where every checkpoint also leaves the
    # weights alone in bfloat16, with the step and the budget spent: a run whose Ray checkpoints are
    # gone (a fresh machine has only what landed) continues from it with the same command, with a
    # fresh optimizer re-warmed over train.warmup_steps (pipelines/train/snapshot.py). None: no snapshot.
    snapshot_dir: str | None = None
    checkpoint_every: int = Field(200, ge=1)
    validate_every: int = Field(200, ge=1)
    validation_prompts: int = Field(8, ge=0)
    micro_batches: int = Field(1, ge=1, le=1024)  # gradient accumulation passes per step (memory ÷ micro_batches)
    chunk_tokens: int = Field(2048, ge=16)  # anchor slots per vocabulary-head chunk (peak ∝ chunk_tokens · V)
    # Stop when held-out val/tau has not risen for this many validations in a row (None: never), after
    # a cool-down (selector stage only).
    early_stop_patience: int | None = Field(None, ge=1)
    # When that rule fires: restore the best validated head and train this many more steps with every
    # ramp at its end value and the learning rate falling linearly to its floor, then export that head
    # (pipelines/train/cooldown.py). None: a tenth of the steps run so far (at least one); 0: stop at
    # once and export the best validated head.
    cooldown_steps: int | None = Field(None, ge=0)
    # End the run at this step while every schedule still runs to max_steps (selector stage only):
    # an ablation stopped at the step where a longer run peaked sees that run's lr and credit ramps.
    stop_at_step: int | None = Field(None, ge=1)


class RaySection(StrictConfig):
    num_workers: int = Field(1, ge=1)
    cpus_per_worker: int = Field(1, ge=1)
    use_gpu: bool = False
    gpus_per_worker: float = Field(1.0, gt=0.0, le=8.0)  # with use_gpu
    accelerator_type: str | None = None  # Ray accelerator type, e.g. "H800" / "A100"; None: any GPU
    runtime_env: dict[str, Any] = Field(default_factory=dict)  # passed to ray.init (env_vars, pip, …)
    strategy: Literal["ddp", "fsdp"] = "ddp"
    storage_path: str = "outputs/ray"
    run_name: str = "smollm2-135m-dflash"
    max_failures: int = Field(2, ge=0)
    # Seconds a collective (DDP's all-reduce) waits for every worker: Ray Train's TorchConfig.timeout_s.
    # Rank 0 validates while the others wait at the next all-reduce, so Ray's 1800 ends a multi-worker
    # run whose 32-prompt validation takes half an hour on a busy CPU (or spans a SIGSTOP pause).
    timeout_s: int = Field(7200, ge=60)
    address: str | None = None  # None: start a local cluster


class MlflowSection(StrictConfig):
    tracking_uri: str | None = None  # None: MLFLOW_TRACKING_URI or the project's SQLite store
    experiment: str = "drelay-train"
    registered_model: str | None = Field(None, pattern=r"^[A-Za-z0-9][\w.+-]{0,99}$")  # register the drafter, alias `champion`


class RunConfig(StrictConfig):
    target: TargetSection = TargetSection()
    drafter: DrafterSection = DrafterSection()
    selector: SelectorSection = SelectorSection()
    data: DataSection = DataSection()
    train: TrainSection = TrainSection()
    ray: RaySection = RaySection()
    mlflow: MlflowSection = MlflowSection()
    output_dir: str = "outputs/train"
    output_root: str | None = None  # where `outputs/…` paths land (else $DRELAY_OUTPUT_ROOT; pipelines/common/outputs.py)

    @model_validator(mode="after")
    def _consistent(self) -> "RunConfig":
        if self.drafter.draft_vocab_size is not None and self.drafter.draft_vocab_size < self.drafter.top_k:
            raise ValueError("drafter.draft_vocab_size must be ≥ drafter.top_k")
        if self.drafter.freeze and (
            self.drafter.init_checkpoint is None or not self.selector.trains_selector or not self.train.selector_loss
        ):
            raise ValueError("drafter.freeze needs drafter.init_checkpoint, a trainable selector.name and train.selector_loss")
        if self.drafter.grow_layers and (self.drafter.init_checkpoint is None or self.drafter.freeze):
            raise ValueError(
                "drafter.grow_layers deepens a trained drafter: it needs drafter.init_checkpoint and no drafter.freeze"
            )
        if self.train.partial_blocks and self.selector.trains_selector:
            raise ValueError(
                "train.partial_blocks trains the drafter alone (a selector's Global Read would read slots a partial "
                "block does not have): it needs selector.name=native"
            )
        if self.train.stage == "selector":
            if not self.drafter.freeze:
                raise ValueError("train.stage: 'selector' trains the head alone on cached blocks; it needs drafter.freeze=true")
            if self.train.scout_policy != "native":
                raise ValueError(
                    "train.stage: 'selector' caches anchors traced once by the argmax; it needs train.scout_policy=native"
                )
            if self.train.soft_labels is not None:
                raise ValueError("train.soft_labels shapes the drafter's support term; the selector stage has none")
            if self.train.drafter_lr_scale != 1.0:
                raise ValueError("train.drafter_lr_scale sets the drafter's rate; the selector stage's drafter is frozen")
            if self.train.stop_at_step is not None and self.train.stop_at_step > self.train.max_steps:
                raise ValueError("train.stop_at_step must be ≤ train.max_steps")
            if self.train.cooldown_steps is not None and self.train.early_stop_patience is None:
                raise ValueError("train.cooldown_steps follows an early stop: it needs train.early_stop_patience")
        elif any(v is not None for v in (self.train.early_stop_patience, self.train.stop_at_step, self.train.cooldown_steps)):
            raise ValueError(
                "train.early_stop_patience / train.stop_at_step / train.cooldown_steps: only the selector stage "
                "(train.stage=selector) stops early"
            )
        return self


def _set_dotted(doc: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = doc
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise DRelayError(f"override '{dotted}': '{key}' is not a section")
    node[keys[-1]] = value


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    """Read a YAML run config (or the defaults) and apply `section.key=value` overrides."""
    doc: dict = read_mapping(path, "config file") if path is not None else {}
    for item in overrides:
        key, eq, raw = item.partition("=")
        if not eq or not key:
            raise DRelayError(f"bad override '{item}': expected section.key=value")
        _set_dotted(doc, key.strip(), yaml.safe_load(raw) if raw.strip() else None)
    return validate_config(RunConfig, doc)
