"""The base of every config schema and the one formatter of its errors.

Every YAML-facing schema (run configs, sweeps, studies, serve configs, the project's cluster files)
derives from `StrictConfig`: an unknown key is an error, so a typo never falls back silently to a
default, and a validated config is immutable, so the one owner that validated it can pass it on.
`one_line` turns pydantic's first error into the project's one-line form, `field.path: message`:

    train.lr: Input should be greater than 0
    stages.0.runs: Field required
"""

from __future__ import annotations

import difflib
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from drelay_model.errors import DRelayError


class StrictConfig(BaseModel):
    """Unknown keys are rejected; instances are frozen (derive with `model_copy(update=...)`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def one_line(exc: ValidationError, *, top: str = "config") -> str:
    """`field.path: message` for the first error of `exc`; `top` names the document when the error is
    about the whole of it (a model validator's check across fields). An unknown key comes first: a
    misspelt required field is reported as the typo it is (with the field it resembles), not as the
    missing field it leaves behind."""
    errors = exc.errors()
    err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    where = ".".join(str(part) for part in err["loc"]) or top
    message = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        parent, key = err["loc"][:-1], str(err["loc"][-1])
        missing = [str(e["loc"][-1]) for e in errors if e["type"] == "missing" and e["loc"][:-1] == parent]
        close = difflib.get_close_matches(key, missing, n=1)
        message += f" (did you mean '{close[0]}'?)" if close else ""
    return f"{where}: {message}"


M = TypeVar("M", bound=BaseModel)


def validate_config(model: type[M], doc: object, *, source: str | None = None, top: str = "config") -> M:
    """`model` validated from `doc`; a failure is a one-line `DRelayError`, prefixed with `source`
    (the file or section it came from) when given."""
    try:
        return model.model_validate(doc)
    except ValidationError as exc:
        message = one_line(exc, top=top)
        raise DRelayError(f"{source}: {message}" if source else message) from None
