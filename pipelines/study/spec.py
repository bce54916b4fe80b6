"""Studies: a declarative set of training runs in stages, then one replay comparison of their results.

A study spec (YAML under platform/studies/) names a base run config per stage, shared
overrides, and labelled runs with their own overrides. Run `<label>` trains as Ray run
`<study>-<label>` (so a rerun resumes it) and exports `<output_dir>/<study>-<label>/drafter`. A later
stage may start from an earlier run's result through the placeholder `{<label>}` in an override:

    name: smollm2-135m
    stages:
      - config: platform/experiments/smollm2-135m/train.yaml
        runs: {base: [train.max_steps=1000]}
      - config: platform/experiments/smollm2-135m/train-drelay.yaml
        overrides: ["drafter.init_checkpoint={base}", train.max_steps=150]
        runs: {native: [selector.name=native], drelay: [], no-global-read: [selector.config.global_read=false]}
    compare: {baseline: native, variants: {drelay-native-pick: "drelay:native"}, limit: 4}
    ship: drelay            # copy that run's checkpoint to checkpoints/<target>/ (the bundled default)

Equal budgets: runs of one stage share every override but their own, so ablations differ from the
full model in exactly one switch. A run whose exported checkpoint already reached its step budget is
skipped; anything else is (re)started and resumes from its latest Ray checkpoint.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from pydantic import Field, field_validator, model_validator

from drelay_model.errors import DRelayError
from drelay_model.decoding import DEFAULT_MAX_NEW_TOKENS, GenerationConfig
from pipelines.common.config_base import StrictConfig, validate_config
from pipelines.common.intervals import DEFAULT_RESAMPLES, DEFAULT_SEED
from pipelines.common.paths import NAME_PATTERN
from pipelines.train.config import RunConfig, load_config

_PLACEHOLDER = re.compile(r"\{([A-Za-z0-9._+-]+)\}")


class StageSpec(StrictConfig):
    config: str  # a run config YAML (repository-relative or absolute)
    overrides: list[str] = Field(default_factory=list)
    runs: dict[str, list[str]] = Field(min_length=1)


class CompareSpec(StrictConfig):
    baseline: str | None = None  # default: the first run of the last stage
    variants: dict[str, str] = Field(default_factory=dict)  # extra columns: label → "<run>" or "<run>:<selector>"
    runs: list[str] | None = None  # runs to compare (default: every run of the last stage)
    # Columns from checkpoints outside the study (label → "DIR" or "DIR:<selector>"), e.g. the shipped
    # checkpoint the study's runs should beat; DIR is repository-relative or absolute.
    checkpoints: dict[str, str] = Field(default_factory=dict)
    benchmarks: str = "all"
    limit: int | None = Field(4, ge=1)
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    data_dir: str | None = None  # benchmark prompts (default: the bundled data/benchmarks)
    out: str | None = None  # default: outputs/compare/<study name>
    bootstrap_resamples: int = Field(DEFAULT_RESAMPLES, ge=100)  # behind every ratio's 95% interval
    bootstrap_seed: int = Field(DEFAULT_SEED, ge=0)

    @field_validator("max_new_tokens")
    @classmethod
    def _budget(cls, v: int) -> int:
        try:
            return GenerationConfig(max_new_tokens=v).max_new_tokens  # the one validator of decode settings
        except DRelayError as exc:
            raise ValueError(str(exc)) from None

    @property
    def decode(self) -> GenerationConfig:
        """Replay is greedy: the budget is the only decode setting a comparison has."""
        return GenerationConfig(max_new_tokens=self.max_new_tokens)


class StudySpec(StrictConfig):
    name: str = Field(pattern=NAME_PATTERN)
    stages: list[StageSpec] = Field(min_length=1)
    compare: CompareSpec | None = CompareSpec()
    ship: str | None = None  # a run label

    @model_validator(mode="after")
    def _labels(self) -> "StudySpec":
        seen: list[str] = []
        for i, stage in enumerate(self.stages):
            for label, overrides in stage.runs.items():
                if not re.match(NAME_PATTERN, label):
                    raise ValueError(f"stages.{i}.runs: bad run label '{label}' (1–64 of [A-Za-z0-9._+-])")
                if label in seen:
                    raise ValueError(f"stages.{i}.runs: run label '{label}' is used twice")
                for ref in _PLACEHOLDER.findall(" ".join(stage.overrides + overrides)):
                    if ref not in seen:
                        raise ValueError(f"stages.{i}: '{{{ref}}}' does not name a run of an earlier stage")
            seen += list(stage.runs)
        c = self.compare
        if c is not None:
            for ref in [*(c.runs or []), *(v.split(":")[0] for v in c.variants.values())]:
                if ref not in seen:
                    raise ValueError(f"compare: '{ref}' is not a run of this study")
            labels = list(c.runs or self.stages[-1].runs) + list(c.variants)
            for label in c.checkpoints:
                if label in labels or not re.match(NAME_PATTERN, label):
                    raise ValueError(f"compare.checkpoints: label '{label}' is used twice or malformed")
            labels += list(c.checkpoints)
            if c.baseline is not None and c.baseline not in labels:
                raise ValueError(f"compare.baseline: '{c.baseline}' is not a compared label ({', '.join(labels)})")
        if self.ship is not None and self.ship not in seen:
            raise ValueError(f"ship: '{self.ship}' is not a run of this study")
        return self

    def run_labels(self) -> list[str]:
        return [label for stage in self.stages for label in stage.runs]

    def compared(self) -> dict[str, str]:
        """Column label → "<run>" or "<run>:<selector>", in table order (runs first)."""
        c = self.compare or CompareSpec()
        return {**{r: r for r in (c.runs or self.stages[-1].runs)}, **c.variants}


def load_study(path: str | Path) -> StudySpec:
    path = Path(path)
    if not path.is_file():
        raise DRelayError(f"study spec '{path}' not found")
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise DRelayError(f"study spec '{path}' is not valid YAML: {str(exc).splitlines()[0]}") from exc
    return validate_config(StudySpec, doc if doc is not None else {}, source=f"study spec '{path}'", top="spec")


def run_configs(spec: StudySpec, repo_path) -> dict[str, RunConfig]:
    """Every run's resolved RunConfig (validated up front, before anything trains)."""
    out: dict[str, RunConfig] = {}
    for stage in spec.stages:
        for label, own in stage.runs.items():
            overrides = [_fill(o, out) for o in stage.overrides + own] + [f"ray.run_name={spec.name}-{label}"]
            try:
                out[label] = load_config(repo_path(stage.config), overrides)
            except DRelayError as exc:
                raise DRelayError(f"study run '{label}': {exc}") from exc
    return out


def final_checkpoint(cfg: RunConfig, repo_path) -> Path:
    return repo_path(cfg.output_dir) / cfg.ray.run_name / "drafter"


def finished(cfg: RunConfig, repo_path) -> bool:
    """True when the run's exported checkpoint exists and is its last one: it reached train.max_steps
    or, with train.max_minutes or train.early_stop_patience, ended early (meta `final`)."""
    import json

    doc = final_checkpoint(cfg, repo_path) / "drafter_config.json"
    try:
        meta = json.loads(doc.read_text()).get("meta", {})
    except (OSError, ValueError):
        return False
    ends_early = cfg.train.max_minutes is not None or cfg.train.early_stop_patience is not None
    return meta.get("step") == cfg.train.max_steps or (ends_early and meta.get("final") is True)


def _fill(override: str, done: dict[str, RunConfig]) -> str:
    """`{label}` → that run's exported checkpoint path, as written in its config (the driver
    resolves relative paths against the repository)."""
    return _PLACEHOLDER.sub(lambda m: str(final_checkpoint(done[m.group(1)], Path)), override)
