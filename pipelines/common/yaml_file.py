"""The one reader of YAML documents users write (run configs, sweeps, serve configs, runtime envs)."""

from __future__ import annotations

from pathlib import Path

import yaml

from drelay_model.errors import DRelayError


def read_mapping(path: str | Path, what: str) -> dict:
    """The YAML mapping in `path`; a one-line DRelayError naming `what` and the file when it is
    missing, not YAML, or not a mapping at the top level. An empty file is an empty mapping."""
    p = Path(path)
    if not p.is_file():
        raise DRelayError(f"{what} '{p}' not found")
    try:
        doc = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise DRelayError(f"{what} '{p}' is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(doc, dict):
        raise DRelayError(f"{what} '{p}' must hold a mapping at the top level")
    return doc
