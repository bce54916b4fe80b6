"""Run configs: strict pydantic models loaded from YAML with dotted overrides.

    drelay train --config platform/experiments/smollm2-135m/train.yaml train.max_steps=200 ray.num_workers=1

Every model forbids unknown keys and range-checks its values, so a typo or a bad value is a one-line
error naming the field (`train.lr: Input should be greater than 0`), never a silent default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from drelay_model.errors import DRelayError


# A label that doubles as a file, MLflow run and Ray run name (compare variants, study runs).
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$"

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TargetSection(_Strict):
    spec: str = "smollm2-135m"
    dtype: Literal["float32", "bfloat16"] = "float32"


class DrafterSection(_Strict):
    num_layers: int = Field(2, ge=1, le=64)
    target_layer_ids: tuple[int, ...] | None = None  # default: early, middle and late layers
    intermediate_size: int | None = Field(None, ge=1)
    block_size: int = Field(16, ge=2, le=64)
    top_k: int = Field(16, ge=1, le=256)
    draft_vocab_size: int | None = Field(None, ge=16)
    init_checkpoint: str | None = None  # start from a trained drafter
    freeze: bool = False  # keep the drafter (backbone) fixed: train only the selector (needs init_checkpoint)


class SelectorSection(_Strict):
    name: str = "none"  # "none" or a trainable selector of the registry (`trainable_selectors()`)
    config: dict[str, Any] = Field(default_factory=dict)
    fresh: bool = False  # start from the selector's initialisation even if drafter.init_checkpoint holds one

    @field_validator("name")
    @classmethod
    def _trainable(cls, name: str) -> str:
        from drelay_model.selectors import trainable_selectors

        allowed = ("none", *trainable_selectors())
        if name not in allowed:
            raise ValueError(f"must be one of {', '.join(allowed)}")
        return name


class DataSection(_Strict):
    regenerated: str = "data/regenerated/smollm2-135m*.jsonl"  # a file or a glob (parallel shards)
    fallback_reference_answers: bool = False  # teacher-forced argmax over reference answers (weaker)
    sources: tuple[str, ...] = ("gsm8k_train", "alpaca5k", "mbpp_train", "fastchat")
    max_seq_len: int = Field(768, ge=32, le=32768)
    validation_fraction: float = Field(0.02, ge=0.0, lt=0.5)
    feature_cache: Literal["none", "disk"] = "none"
    feature_cache_dir: str = "outputs/feature_cache"


class Schedule(_Strict):
    """A value ramped linearly from `start` to `end` over the first `ramp_fraction` of training."""

    start: float
    end: float
    ramp_fraction: float = Field(1.0, gt=0.0, le=1.0)

    def at(self, progress: float) -> float:
        t = min(max(progress / self.ramp_fraction, 0.0), 1.0)
        return self.start + (self.end - self.start) * t


class TrainSection(_Strict):
    max_steps: int = Field(2000, ge=1)
    seqs_per_step: int = Field(4, ge=1)  # per worker
    anchors_per_seq: int = Field(16, ge=1, le=512)
    lr: float = Field(6e-4, gt=0.0, le=1.0)
    warmup_steps: int = Field(50, ge=0)
    weight_decay: float = Field(0.0, ge=0.0)
    grad_clip: float = Field(1.0, gt=0.0)
    slot_decay: float = Field(7.0, gt=0.0)  # support weight of slot i ∝ exp(-(i-1)/slot_decay) (DFlash)
    native_anchor_fraction: Schedule = Schedule(start=0.3, end=0.5)
    selector_alpha: Schedule = Schedule(start=0.05, end=1.0)
    credit_blend: Schedule = Schedule(start=0.0, end=1.0, ramp_fraction=0.5)
    credit_cap: float = Field(4.0, ge=1.0)
    credit_floor: float = Field(0.1, ge=0.0, le=1.0)
    support_loss: bool = True
    selector_loss: bool = True
    uniform_repair_weights: bool = False
    bf16: bool = True
    seed: int = 0
    checkpoint_every: int = Field(200, ge=1)
    validate_every: int = Field(200, ge=1)
    validation_prompts: int = Field(8, ge=0)


class RaySection(_Strict):
    num_workers: int = Field(1, ge=1)
    cpus_per_worker: int = Field(1, ge=1)
    use_gpu: bool = False
    strategy: Literal["ddp", "fsdp"] = "ddp"
    storage_path: str = "outputs/ray"
    run_name: str = "smollm2-135m-dflash"
    max_failures: int = Field(2, ge=0)
    address: str | None = None  # None: start a local cluster


class MlflowSection(_Strict):
    tracking_uri: str | None = None  # None: MLFLOW_TRACKING_URI or the project's SQLite store
    experiment: str = "drelay-train"


class RunConfig(_Strict):
    target: TargetSection = TargetSection()
    drafter: DrafterSection = DrafterSection()
    selector: SelectorSection = SelectorSection()
    data: DataSection = DataSection()
    train: TrainSection = TrainSection()
    ray: RaySection = RaySection()
    mlflow: MlflowSection = MlflowSection()
    output_dir: str = "outputs/train"

    @model_validator(mode="after")
    def _consistent(self) -> "RunConfig":
        if self.drafter.draft_vocab_size is not None and self.drafter.draft_vocab_size < self.drafter.top_k:
            raise ValueError("drafter.draft_vocab_size must be ≥ drafter.top_k")
        if self.drafter.freeze and (self.drafter.init_checkpoint is None or self.selector.name == "none" or not self.train.selector_loss):
            raise ValueError("drafter.freeze needs drafter.init_checkpoint, a trainable selector.name and train.selector_loss")
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
    doc: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise DRelayError(f"config file '{path}' not found")
        try:
            doc = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise DRelayError(f"config file '{path}' is not valid YAML: {str(exc).splitlines()[0]}") from exc
        if not isinstance(doc, dict):
            raise DRelayError(f"config file '{path}' must hold a mapping at the top level")
    for item in overrides:
        key, eq, raw = item.partition("=")
        if not eq or not key:
            raise DRelayError(f"bad override '{item}': expected section.key=value")
        _set_dotted(doc, key.strip(), yaml.safe_load(raw) if raw.strip() else None)
    try:
        return RunConfig.model_validate(doc)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "config"
        raise DRelayError(f"{where}: {err['msg']}") from exc
