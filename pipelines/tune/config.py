"""Sweep configs: a base training config, a search space over its dotted paths, search and scheduler.

    name: smollm2-135m-credit
    base: platform/experiments/smollm2-135m/train.yaml      # a path, or an inline mapping
    overrides: [drafter.init_checkpoint=checkpoints/smollm2-135m]
    space:
      train.selector_alpha.end: {low: 0.5, high: 1.0}       # uniform
      train.lr: {low: 1.0e-4, high: 1.0e-3, log: true}      # log-uniform
      train.credit_cap: {values: [2.0, 4.0, 8.0]}           # categorical (grid: the grid points)
    search: random                                          # random | grid | optuna (TPE)
    scheduler: {name: asha, grace_period: 20, reduction_factor: 2, max_steps: 60}

Everything is checked before any trial starts, as a one-line error naming the field: unknown keys, a
path that is not a training-config field, an empty or inverted range, and endpoints (or values) that
the training config itself rejects — each endpoint is validated by building the training config with it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, model_validator

from drelay_model.errors import DRelayError
from pipelines.common.paths import NAME_PATTERN
from pipelines.common.config_base import StrictConfig, validate_config
from pipelines.train.config import RunConfig, _set_dotted
from pipelines.common.paths import REPO_ROOT
from pipelines.train.worker import HEADLINE_METRIC
from pipelines.common.yaml_file import read_mapping


class ParamSpace(StrictConfig):
    """One swept value: a range `[low, high]` (uniform, or log-uniform with `log`) or a list of `values`."""

    low: float | None = None
    high: float | None = None
    log: bool = False
    values: tuple[Any, ...] | None = None

    @model_validator(mode="after")
    def _shape(self) -> "ParamSpace":
        if self.values is not None:
            if self.low is not None or self.high is not None:
                raise ValueError("give either low/high or values, not both")
            if not self.values:
                raise ValueError("values is empty")
            if len(set(map(repr, self.values))) != len(self.values):
                raise ValueError("values has duplicates")
            return self
        if self.low is None or self.high is None:
            raise ValueError("give low and high (a range) or values (a list)")
        if self.low == self.high:
            raise ValueError(f"empty range: low = high = {self.low}")
        if self.low > self.high:
            raise ValueError(f"inverted range: low {self.low} > high {self.high}")
        if self.log and self.low <= 0:
            raise ValueError("a log range needs low > 0")
        return self

    def endpoints(self) -> tuple[Any, ...]:
        """The values to validate against the training config: the range's ends, or every value."""
        return self.values if self.values is not None else (self.low, self.high)


class SchedulerSection(StrictConfig):
    """ASHA stops a trial at a rung (grace_period · reduction_factor^k steps) when its metric falls
    outside the top 1/reduction_factor of trials that reached that rung; fifo runs every trial out."""

    name: Literal["asha", "fifo"] = "asha"
    grace_period: int = Field(1, ge=1)  # steps before a trial can be stopped
    reduction_factor: float = Field(2.0, gt=1.0)  # the rung spacing is a log in this base
    max_steps: int | None = Field(None, ge=1)  # each trial's budget; None: the base config's train.max_steps


class ResourcesSection(StrictConfig):
    """Per trial: the Tune trial driver's small CPU share, and its Ray Train workers (None: the base's)."""

    driver_cpu: float = Field(0.1, gt=0.0, le=64.0)
    num_workers: int | None = Field(None, ge=1)
    cpus_per_worker: int | None = Field(None, ge=1)


class SweepConfig(StrictConfig):
    name: str = Field(pattern=NAME_PATTERN)  # the Tune experiment, the MLflow parent run, the output folder
    base: str | dict[str, Any]  # a training config YAML (path) or an inline training config
    overrides: tuple[str, ...] = ()  # dotted `section.key=value` overrides of the base
    space: dict[str, ParamSpace] = Field(min_length=1)
    search: Literal["random", "grid", "optuna"] = "random"
    scheduler: SchedulerSection = SchedulerSection()
    metric: str = HEADLINE_METRIC
    mode: Literal["max", "min"] = "max"
    num_samples: int = Field(8, ge=1)  # random/optuna: trials; grid: repeats of the whole grid
    max_concurrent_trials: int = Field(1, ge=1)
    resources: ResourcesSection = ResourcesSection()
    seed: int = 0
    output_dir: str = "outputs/sweeps"
    experiment: str = "drelay-tune"  # MLflow experiment of the parent run and its nested trial runs


def load_base(sweep: SweepConfig) -> dict:
    """The base training config as a document (YAML + overrides applied), validated once. A relative
    path is read from the working directory, else from the repository root."""
    if isinstance(sweep.base, dict):
        doc = dict(sweep.base)
    else:
        path = Path(sweep.base).expanduser()
        path = path if path.is_absolute() or path.exists() else REPO_ROOT / path
        if not path.is_file():
            raise DRelayError(f"base: training config '{sweep.base}' not found")
        doc = yaml.safe_load(path.read_text()) or {}
        if not isinstance(doc, dict):
            raise DRelayError(f"base: '{sweep.base}' must hold a mapping at the top level")
    for item in sweep.overrides:
        key, eq, raw = item.partition("=")
        if not eq or not key:
            raise DRelayError(f"overrides: bad override '{item}': expected section.key=value")
        _set_dotted(doc, key.strip(), yaml.safe_load(raw) if raw.strip() else None)
    # The resolved document (every default spelled out), so a swept path inside a defaulted
    # section (train.selector_alpha.end) lands next to its siblings.
    return load_doc(doc, "base").model_dump(mode="json")


def load_doc(doc: dict, where: str) -> RunConfig:
    """Validate a training-config document; a failure is one line prefixed with `where`."""
    return validate_config(RunConfig, doc, source=where)


def field_path_error(path: str) -> str | None:
    """Why `path` is not a leaf field of the training config (None if it is one)."""
    model: type[BaseModel] = RunConfig
    keys = path.split(".")
    for i, key in enumerate(keys):
        fields = model.model_fields
        if key not in fields:
            where = ".".join(keys[:i]) or "the training config"
            return f"'{path}' is not a training-config field ({where} has: {', '.join(fields)})"
        annotation = fields[key].annotation
        last = i == len(keys) - 1
        if not last and getattr(annotation, "__origin__", None) is dict:
            return None  # a key of a free-form mapping (selector.config.d_sel): its owner checks it when the trial builds
        is_model = isinstance(annotation, type) and issubclass(annotation, BaseModel)
        if last and is_model:
            return f"'{path}' is a section; sweep one of its fields ({', '.join(annotation.model_fields)})"
        if not last and not is_model:
            return f"'{path}': '{'.'.join(keys[: i + 1])}' is a value, not a section"
        model = annotation if is_model else model
    return None


def check_space(sweep: SweepConfig, base_doc: dict) -> None:
    """Every swept path is a training-config field and every endpoint/value is one it accepts."""
    import copy

    for path, space in sweep.space.items():
        problem = field_path_error(path)
        if problem:
            raise DRelayError(f"space: {problem}")
        for value in space.endpoints():
            doc = copy.deepcopy(base_doc)
            _set_dotted(doc, path, value)
            try:
                load_doc(doc, f"space.{path}")
            except DRelayError as exc:
                raise DRelayError(f"{exc} (value {value!r})") from None
        if sweep.search == "grid" and space.values is None:
            raise DRelayError(f"space.{path}: grid search needs a list of values, not a range")


def load_sweep(path: str | Path) -> tuple[SweepConfig, dict]:
    """Read and check a sweep file: (the sweep, the validated base training document)."""
    path = Path(path)
    doc = read_mapping(path, "sweep config")
    sweep = validate_config(SweepConfig, doc, top="sweep")
    if sweep.search == "optuna":
        try:
            import optuna  # noqa: F401
        except ImportError:
            raise DRelayError("search: optuna is not installed (pip install 'drelay[tune]')") from None
    base_doc = load_base(sweep)
    check_space(sweep, base_doc)
    check_continuation(sweep, base_doc)
    return sweep, base_doc


def check_continuation(sweep: SweepConfig, base_doc: dict) -> None:
    """A sweep that continues a checkpoint (`drafter.init_checkpoint`) trains on from it: no warm-up
    (a fresh climb to a peak rate undoes what the checkpoint's decayed rate had settled) in the base
    or in any swept value, so the learning rate the trials start at is the one the overrides give."""
    if not base_doc["drafter"].get("init_checkpoint"):
        return
    if base_doc["drafter"].get("freeze") and base_doc["selector"].get("fresh"):
        return  # a fresh head on a fixed drafter: nothing trained is continued, a warm-up is the head's own
    warmups = [
        base_doc["train"]["warmup_steps"],
        *(sweep.space["train.warmup_steps"].endpoints() if "train.warmup_steps" in sweep.space else ()),
    ]
    if any(w != 0 for w in warmups):
        raise DRelayError(
            "overrides: train.warmup_steps must be 0 in a sweep that continues drafter.init_checkpoint "
            "(train on at the checkpoint's decayed rate: set train.lr to it and train.warmup_steps=0)"
        )
