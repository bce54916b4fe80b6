"""JSONL files as stored on disk: plain while a run appends to them, xz-compressed once finished.

A data file is named by its plain path `X.jsonl`; its records live in
    X.jsonl      plain text: what `drelay data regenerate` appends to, batch by batch (resumable)
    X.jsonl.xz   the finished records, xz-compressed (the bundled SmolLM2 corpus: 26.9 MB → 3.4 MB)
    X.jsonl.gz   read as well (a gzip'ed copy made by hand)
Readers take every form present; a record held by two forms (an interrupted compression) counts
once, as `read_sequences` and `read_done` key records. Paths or globs may name the plain file, the
compressed one, or either: `data/regenerated/smollm2-135m*.jsonl` also matches the `.jsonl.xz` files.

Compression is atomic: the plain records are appended behind the compressed ones in a temporary
`X.jsonl.xz.tmp`, synced and renamed over `X.jsonl.xz`; only then is the plain file removed. An
interrupted compression leaves either the old pair or the new `.xz` (plus, at worst, the plain file
whose records it already holds).
"""

from __future__ import annotations

import gzip
import json
import lzma
import os
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

from drelay_model.errors import DRelayError

COMPRESSED_SUFFIXES = (".xz", ".gz")
# What reading a damaged or truncated compressed file raises (EOFError: a stream cut short).
DECOMPRESSION_ERRORS = (lzma.LZMAError, gzip.BadGzipFile, EOFError, zlib.error)
XZ_PRESET = 6  # 8 MiB dictionary: as small as preset 9 on the bundled corpus (within 0.2%), less memory


def plain_path(path: str | Path) -> Path:
    """`X.jsonl` for any of `X.jsonl`, `X.jsonl.xz`, `X.jsonl.gz`."""
    path = Path(path)
    return path.with_suffix("") if path.suffix in COMPRESSED_SUFFIXES else path


def stored_forms(path: str | Path) -> list[Path]:
    """The files that hold the records of the data file `path` (compressed first, then plain)."""
    plain = plain_path(path)
    candidates = [plain.with_name(plain.name + s) for s in COMPRESSED_SUFFIXES] + [plain]
    return [p for p in candidates if p.is_file()]


def matching_files(pattern: str | Path) -> list[Path]:
    """Files matching a glob, or matching it once a compression suffix is added (sorted, unique)."""
    pattern = Path(pattern)
    names = [pattern.name] + [pattern.name + s for s in COMPRESSED_SUFFIXES]
    return sorted({p for name in names for p in pattern.parent.glob(name) if p.is_file()})


def open_text(path: str | Path) -> TextIO:
    """Open a plain, `.xz` or `.gz` file for reading UTF-8 text."""
    path = Path(path)
    if path.suffix == ".xz":
        return lzma.open(path, "rt", encoding="utf-8")
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open(encoding="utf-8")


def read_text(path: str | Path) -> str:
    """The whole text of a plain or compressed file; a damaged compressed file is a DRelayError."""
    try:
        with open_text(path) as f:
            return f.read()
    except DECOMPRESSION_ERRORS as exc:
        raise DRelayError(f"{path}: not a readable compressed file ({exc or type(exc).__name__})") from exc


def complete_lines(path: str | Path) -> Iterator[str]:
    """The newline-terminated lines of a file (a torn last line, from a killed writer, is left out)."""
    with open_text(path) as f:
        for line in f:
            if line.endswith("\n"):
                yield line


def compress_into_xz(plain: str | Path, key: Callable[[dict], str]) -> Path:
    """Move the records of the plain file `plain` into `plain.xz` (behind the records it already
    holds, skipping keys it has), atomically; then remove `plain`. Returns the `.xz` path."""
    plain = Path(plain)
    xz = plain.with_name(plain.name + ".xz")
    tmp = xz.with_name(xz.name + ".tmp")
    try:
        with lzma.open(tmp, "wt", encoding="utf-8", preset=XZ_PRESET) as out:
            seen: set[str] = set()
            for source in ([xz] if xz.is_file() else []) + [plain]:
                for line in complete_lines(source):
                    k = key(json.loads(line))
                    if k not in seen:
                        seen.add(k)
                        out.write(line)
        with tmp.open("rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, xz)
        _fsync_directory(xz.parent)
    except OSError as exc:
        raise DRelayError(f"cannot write '{xz}': {exc.strerror or exc}") from exc
    finally:
        tmp.unlink(missing_ok=True)
    plain.unlink()
    return xz


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
