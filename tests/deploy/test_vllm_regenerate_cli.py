"""`drelay data regenerate --engine vllm` in the default suite (no vLLM needed): without the vLLM venv
it is one line saying how to get it, exit 2, nothing written; a Ray Data job's results count only when
the job finished every row; bench_peers' table keeps only what both engines finished. The real runs
are in tests/deploy/test_vllm_peer.py (`make test-vllm`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pipelines.cli.main import main as drelay
from pipelines.data.regenerate_vllm import _read_answers

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_peers import compare  # noqa: E402


def test_engine_vllm_without_the_venv_is_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DRELAY_VLLM_PYTHON", str(tmp_path / "no-venv" / "python"))
    out = tmp_path / "out" / "r.jsonl"
    rc = drelay(["data", "regenerate", "--engine", "vllm", "--limit", "1", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "make vllm-env" in err and "\n" not in err
    assert not out.parent.exists()


def test_bad_engine_is_exit_2(capsys):
    try:
        rc = drelay(["data", "regenerate", "--engine", "sglang"])
    except SystemExit as exc:  # argparse's own exit
        rc = exc.code
    assert rc == 2 and "--engine" in capsys.readouterr().err


def test_job_results_count_only_when_every_row_finished(tmp_path):
    res = tmp_path / "results.jsonl"
    assert _read_answers(res, 2) is None  # no file: the job never wrote
    res.write_text(json.dumps({"key": "1", "token_ids": [5, 2]}) + "\n" + json.dumps({"key": "0", "token_ids": [7]}) + "\n")
    assert _read_answers(res, 2) is None  # rows but no summary: the job was cut
    res.write_text(res.read_text() + json.dumps({"summary": {"rows": 2}}) + "\n")
    assert _read_answers(res, 2) == [[7], [5, 2]]  # prompt order, whatever order Ray Data streamed
    assert _read_answers(res, 3) is None  # a row missing


def test_bench_peers_table_keeps_what_both_engines_finished():
    row = {"tok_s": 10.0, "tau": 1.0, "tokens": [[1, 2]]}
    ours = {"ar": {1: row, 8: row}, "native": {1: {**row, "tau": 2.0}}}
    peer = {"ar": {"load_s": 5.0, 1: {**row, "tok_s": 5.0}}, "native": {"load_s": None}}
    table = compare(ours, peer, [1, 8])
    assert list(table["ar"]) == [1] and table["ar"][1]["ratio"] == 2.0 and table["ar"][1]["same_outputs"] == 1
    assert table["native"] == {}
