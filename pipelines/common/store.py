"""One JSON file per key, written atomically: the platform's resumable result store.

    <root>/<benchmark>__<name>.json      (evaluation cells: name = method; replay cells: name = label)

`load` returns None for a missing, torn, outdated (unparseable) or stale (other fingerprint) file,
so the caller recomputes it; `save` writes to a temporary file and renames it over the old one, so a
crash never leaves half a file. Records are dataclasses with `from_dict` and a `fingerprint` field.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar


class Record(Protocol):
    benchmark: str
    fingerprint: str

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Any: ...


R = TypeVar("R", bound=Record)


class JsonStore(Generic[R]):
    """Records of type `record` under `root`, keyed by (benchmark, name); `name_of` reads a record's name."""

    def __init__(self, root: str | Path, record: type[R], name_of) -> None:
        self.root, self.record, self.name_of = Path(root), record, name_of

    def path(self, benchmark: str, name: str) -> Path:
        return self.root / f"{benchmark}__{name}.json"

    def load(self, benchmark: str, name: str, fp: str) -> R | None:
        """The stored record if it exists, parses and matches `fp`; None otherwise (recompute)."""
        try:
            rec = self.record.from_dict(json.loads(self.path(benchmark, name).read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            return None  # missing, torn or of an outdated layout
        return rec if rec.fingerprint == fp else None

    def save(self, rec: R) -> Path:
        path = self.path(rec.benchmark, self.name_of(rec))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(rec) if not hasattr(rec, "to_dict") else rec.to_dict()))
        os.replace(tmp, path)
        return path
