"""One strict-config base and one error formatter (pipelines/common/config_base.py) serve every config
schema; chat prompts are rendered in one place (pipelines/common/chat.py). Checked on the real
schemas and, for "one place", by reading the product's source with `ast`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from pydantic import Field, ValidationError, model_validator

from deploy.serve.config import ServeConfig
from drelay_model.errors import DRelayError
from pipelines.cluster.specs import NodeType, RuntimeEnvSpec
from pipelines.common.config_base import StrictConfig, one_line, validate_config
from pipelines.study.spec import StudySpec, load_study
from pipelines.train.config import RunConfig, load_config
from pipelines.tune.config import SweepConfig

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("drelay_model", "pipelines", "deploy", "benchmarks")
# The OpenAI request body is not a config: it is strict about types (no coercion) and answers HTTP 400
# with an OpenAI error object, so it keeps its own base and its own error mapping.
REQUEST_BODY = "deploy/serve/protocol.py"


def _calls(attribute: str) -> set[str]:
    """Product files that call `<anything>.<attribute>(...)`."""
    found = set()
    for pkg in PRODUCT:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            source = path.read_text()
            if attribute not in source:
                continue  # cannot call it (the cheap test first: ast.parse is the slow part)
            tree = ast.parse(source, filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == attribute:
                    found.add(path.relative_to(ROOT).as_posix())
    return found


def _model_configs() -> set[str]:
    """Product files that set a pydantic `model_config`."""
    found = set()
    for pkg in PRODUCT:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "model_config = ConfigDict(" in path.read_text():
                found.add(path.relative_to(ROOT).as_posix())
    return found


def test_one_base_one_formatter_one_chat_renderer():
    # pipelines/cluster/specs.py also declares the open base of Kubernetes objects (extra="allow").
    assert _model_configs() == {"pipelines/common/config_base.py", "pipelines/cluster/specs.py", REQUEST_BODY}
    assert _calls("errors") == {"pipelines/common/config_base.py", REQUEST_BODY}
    assert _calls("apply_chat_template") == {"pipelines/common/chat.py"}


@pytest.mark.parametrize("schema", [RunConfig, SweepConfig, StudySpec, ServeConfig, RuntimeEnvSpec, NodeType])
def test_every_config_schema_is_strict_and_frozen(schema):
    assert issubclass(schema, StrictConfig)
    assert schema.model_config["extra"] == "forbid" and schema.model_config["frozen"] is True


def test_a_loaded_study_is_immutable(tmp_path):
    path = tmp_path / "study.yaml"
    path.write_text("name: s\nstages: [{config: platform/experiments/smollm2-135m/train.yaml, runs: {a: []}}]\n")
    spec = load_study(path)
    with pytest.raises(ValidationError, match="frozen"):
        spec.name = "other"
    with pytest.raises(ValidationError, match="frozen"):
        spec.compare.limit = 1


class _Inner(StrictConfig):
    rate: float = Field(gt=0)  # required


class _Doc(StrictConfig):
    inner: list[_Inner] = Field(default_factory=list)
    low: int = 0
    high: int = 1

    @model_validator(mode="after")
    def _ordered(self) -> "_Doc":
        if self.low > self.high:
            raise ValueError("low must be ≤ high")
        return self


@pytest.mark.parametrize("doc, top, message", [
    ({"inner": [{"rate": 1}, {"rate": 0}]}, "config", "inner.1.rate: Input should be greater than 0"),
    ({"inner": [{"rte": 1}]}, "config", "inner.0.rte: Extra inputs are not permitted (did you mean 'rate'?)"),
    ({"inner": [{"rate": 1, "x": 1}]}, "config", "inner.0.x: Extra inputs are not permitted"),
    ({"low": 3}, "config", "config: low must be ≤ high"),  # a cross-field check: no "Value error, "
    ({"low": 3}, "(top level)", "(top level): low must be ≤ high"),
])  # fmt: skip
def test_one_line_names_the_field(doc, top, message):
    with pytest.raises(ValidationError) as info:
        _Doc.model_validate(doc)
    assert one_line(info.value, top=top) == message


def test_validate_config_raises_one_line_drelay_errors():
    assert validate_config(_Doc, {"low": 1}).low == 1
    with pytest.raises(DRelayError) as info:
        validate_config(_Doc, {"high": "x"}, source="f.yaml")
    assert str(info.value) == "f.yaml: high: Input should be a valid integer, unable to parse string as an integer"
    assert info.value.__cause__ is None


@pytest.mark.parametrize("overrides, message", [
    (["train.lr=-1"], "train.lr: Input should be greater than 0"),
    (["train.lrr=1"], "train.lrr: Extra inputs are not permitted"),
])  # fmt: skip
def test_run_config_errors_keep_their_form(overrides, message):
    with pytest.raises(DRelayError) as info:
        load_config(None, overrides)
    assert str(info.value) == message
