"""`drelay data regenerate --engine vllm` in the default suite (no vLLM needed): without the vLLM venv
it is one line saying how to get it, exit 2, nothing written; a Ray Data job's results count only when
the job finished every row; bench_peers' table keeps only what both engines finished. The real runs
are in tests/deploy/test_vllm_peer.py (`make test-vllm`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from cli.main import main as drelay
from deploy.vllm.regenerate import _read_answers

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_peers import compare, fast_vs_reference  # noqa: E402


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


def test_bench_peers_fast_vs_reference_rows_need_all_three_runs():
    row = {"tok_s": 10.0, "tau": 1.0, "tokens": [[1, 2], [3]]}
    ours = {"native": {1: row, 8: row}, "drelay": {1: {**row, "tok_s": 9.0}, 8: row},
            "drelay-ref": {1: {**row, "tok_s": 6.0, "tokens": [[1, 2], [4]]}}}  # fmt: skip
    rows = fast_vs_reference(ours, [1, 8])
    assert list(rows) == [1]  # batch 8 has no reference run
    assert rows[1]["fast_over_ref"] == 1.5 and rows[1]["fast_over_native"] == 0.9 and rows[1]["ref_over_native"] == 0.6
    assert rows[1]["same_tokens"] == 1
    assert fast_vs_reference({"native": {1: row}, "drelay": {1: row}}, [1]) == {}  # run without --reference-select


def test_profile_vllm_plugin_takes_medians_per_batch_size():
    from profile_vllm_plugin import glue_table, parse_args

    lines = [
        {"batch": b, "stage_ms": 1.0 * i, "logits_ms": 3.0, "pool_ms": 2.0, "history_ms": 0.5, "select_ms": 10.0 + i}
        for i, b in enumerate([1, 1, 1, 8, 3])
    ]
    table = glue_table(lines, [1, 8, 16])
    assert table[1] == {"steps": 3, "stage_ms": 1.0, "logits_ms": 3.0, "pool_ms": 2.0, "history_ms": 0.5, "select_ms": 11.0}
    assert table[8]["steps"] == 1 and 16 not in table and 3 not in table
    with pytest.raises(SystemExit):
        parse_args(["--batch-sizes", "1,x"])


def test_a_child_past_its_time_is_killed_with_its_whole_process_group(tmp_path):
    """What bench_peers and the Ray Data job rely on: vLLM's engine core and workers (here: a shell's
    background child) die with the process that started them when it runs out of time."""
    import os
    import time

    from deploy.vllm.peer import run_in_group

    log = tmp_path / "child.log"
    t0 = time.monotonic()
    rc = run_in_group(["sh", "-c", "sleep 120 & echo $!; wait"], log, 2, cwd=str(tmp_path), env=dict(os.environ))
    grandchild = int(log.read_text().split()[0])
    assert rc is None and time.monotonic() - t0 < 30
    time.sleep(0.5)
    assert not Path(f"/proc/{grandchild}").exists() or "Z" in Path(f"/proc/{grandchild}/stat").read_text().split()[2]
    assert run_in_group(["sh", "-c", "exit 3"], log, 10, cwd=str(tmp_path), env=dict(os.environ)) == 3
