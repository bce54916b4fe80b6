"""Data files stored compressed (pipelines/data/stored_jsonl.py): read transparently by the training
loader and by resumed regeneration, compressed atomically, the bundled corpus among them."""

from __future__ import annotations

import gzip
import json
import lzma
import os

import pytest

from drelay_model.errors import DRelayError
from pipelines.common.paths import REPO_ROOT
from pipelines.data.regenerate import output_plan, read_done, read_done_ids, record_key
from pipelines.data.stored_jsonl import compress_into_xz, read_text, stored_forms
from pipelines.train.data import data_files, read_sequences

ROWS = [
    {"source": "s", "conv_id": str(i), "seq_id": f"q{i}", "input_ids": list(range(3 + i)), "response_start": 1} for i in range(5)
]


def _lines(rows) -> str:
    # non-ASCII and U+2028 inside strings, as the regenerated data writes them
    return "".join(json.dumps({**r, "note": "é\u2028x"}, ensure_ascii=False) + "\n" for r in rows)


def test_compressed_data_reads_like_the_plain_file(tmp_path):
    plain, packed = tmp_path / "plain" / "d.jsonl", tmp_path / "packed" / "d.jsonl"
    plain.parent.mkdir()
    packed.parent.mkdir()
    plain.write_text(_lines(ROWS), encoding="utf-8")
    packed.write_text(_lines(ROWS), encoding="utf-8")
    xz = compress_into_xz(packed, record_key)
    assert xz.name == "d.jsonl.xz" and not packed.exists()
    assert lzma.decompress(xz.read_bytes()) == plain.read_bytes()  # byte for byte
    want = read_sequences(plain, max_seq_len=64)
    for name in ("d.jsonl", "d.jsonl.xz", "d*.jsonl"):  # the plain name, the stored name, a glob
        assert read_sequences(tmp_path / "packed" / name, max_seq_len=64) == want
    gz = tmp_path / "gz" / "d.jsonl.gz"
    gz.parent.mkdir()
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    assert read_sequences(tmp_path / "gz" / "d.jsonl", max_seq_len=64) == want


def test_both_forms_are_read_and_a_record_in_both_counts_once(tmp_path):
    out = tmp_path / "d.jsonl"
    out.write_text(_lines(ROWS[:3]))
    compress_into_xz(out, record_key)
    out.write_text(_lines(ROWS[2:]))  # ROWS[2] again: a compression interrupted before the unlink
    assert data_files(out) == [tmp_path / "d.jsonl.xz", out]
    assert [s.seq_id for s in read_sequences(out, max_seq_len=64)] == [f"q{i}" for i in range(5)]
    assert read_done(out) == {f"s/{i}" for i in range(5)}
    compress_into_xz(out, record_key)
    assert stored_forms(out) == [tmp_path / "d.jsonl.xz"]
    assert [json.loads(x)["conv_id"] for x in read_text(tmp_path / "d.jsonl.xz").split("\n")[:-1]] == ["0", "1", "2", "3", "4"]


def test_a_failed_compression_leaves_both_files_as_they_were(tmp_path, monkeypatch):
    out = tmp_path / "d.jsonl"
    out.write_text(_lines(ROWS[:2]))
    xz = compress_into_xz(out, record_key)
    before = xz.read_bytes()
    out.write_text(_lines(ROWS[2:]))

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(DRelayError, match="cannot write .*d.jsonl.xz': No space left on device"):
        compress_into_xz(out, record_key)
    assert xz.read_bytes() == before and out.read_text() == _lines(ROWS[2:])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl", "d.jsonl.xz"]  # no temp file left


def test_damaged_compressed_files_are_one_line_errors(tmp_path):
    out = tmp_path / "d.jsonl"
    out.write_text(_lines(ROWS))
    good = compress_into_xz(out, record_key).read_bytes()
    (tmp_path / "d.jsonl.xz").write_bytes(good[: len(good) // 2])  # cut short
    with pytest.raises(DRelayError, match="d.jsonl.xz: not a readable compressed file"):
        read_sequences(out, max_seq_len=64)
    with pytest.raises(DRelayError, match="d.jsonl.xz: not a readable compressed file"):
        read_done(out)
    (tmp_path / "d.jsonl.xz").write_bytes(b"not xz at all")
    with pytest.raises(DRelayError, match="not a readable compressed file"):
        read_sequences(tmp_path / "d*.jsonl", max_seq_len=64)


def test_shards_see_their_compressed_siblings(tmp_path, monkeypatch):
    monkeypatch.setattr("pipelines.data.regenerate.REPO_ROOT", tmp_path)
    folder = tmp_path / "data" / "regenerated"
    folder.mkdir(parents=True)
    (folder / "t.shard-0-of-2.jsonl").write_text(_lines(ROWS[:2]))
    compress_into_xz(folder / "t.shard-0-of-2.jsonl", record_key)
    (folder / "t.shard-1-of-2.jsonl").write_text(_lines(ROWS[2:3]))
    path, elsewhere = output_plan("t", None, (1, 2))
    assert path == folder / "t.shard-1-of-2.jsonl" and elsewhere == {"s/0", "s/1"}
    path, elsewhere = output_plan("t", str(folder / "t.shard-0-of-2.jsonl.xz"), (0, 2))
    assert path == folder / "t.shard-0-of-2.jsonl" and elsewhere == {"s/2"}


def test_the_bundled_corpus_is_stored_compressed_and_complete():
    files = data_files(REPO_ROOT / "data/regenerated/smollm2-135m*.jsonl")  # the training configs' glob
    assert [f.name for f in files] == [f"smollm2-135m{s}.jsonl.xz" for s in ("", ".shard-0-of-2", ".shard-1-of-2")]
    keys = [read_done_ids(f) for f in files]
    assert sum(map(len, keys)) == len(set().union(*keys)) == 13_441
