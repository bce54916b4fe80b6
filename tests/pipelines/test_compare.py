"""`drelay compare`: replay τ of checkpoints side by side, ratios to a baseline, resume, MLflow, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from drelay_model.decoding.replay import replay
from drelay_model.drafter import BlockDrafter, DrafterConfig, load_drafter, save_drafter
from drelay_model.selectors import default_registry
from pipelines.eval import compare
from pipelines.data.eval_sets import load_benchmark
from cli import main
from pipelines.eval.prompts import HashEncoder
from pipelines.common.tracking import get_client


@pytest.fixture
def checkpoints(tiny, tmp_path) -> tuple[Path, Path]:
    """(a native drafter, another drafter saved with a freshly initialised DRelay selector)."""
    torch.manual_seed(0)
    a = BlockDrafter(DrafterConfig.for_target(tiny, num_layers=1, top_k=8), tiny)
    torch.manual_seed(1)
    b = BlockDrafter(DrafterConfig.for_target(tiny, num_layers=1, top_k=8), tiny)
    sel = default_registry().create("drelay", drafter=b, config={"d_sel": 32, "read_dim": 32, "history_len": 8})
    save_drafter(a, tmp_path / "a")
    extra = {f"selector.{k}": v for k, v in sel.state_dict().items()}
    save_drafter(b, tmp_path / "b", extra_tensors=extra, meta={"selector": {"name": "drelay", "config": sel.config.to_dict()}})
    return tmp_path / "a", tmp_path / "b"


def _args(data_dir, out, a, b, *extra):
    return ["compare", "--target", "tiny-llama", "--data-dir", str(data_dir), "--benchmarks", "gsm8k,mt_bench", "--limit", "2",
            "--max-new-tokens", "12", "--no-progress", "--out", str(out), "--run-name", "cmp",
            "--variant", f"native={a}", "--variant", f"drelay={b}", "--variant", f"drelay-native-pick={b}:native", *extra]  # fmt: skip


def test_compare_table_matches_direct_replay_and_resumes(tiny, uri, data_dir, checkpoints, tmp_path, capsys, monkeypatch):
    a, b = checkpoints
    out = tmp_path / "out"
    assert main(_args(data_dir, out, a, b)) == 0
    printed = capsys.readouterr().out
    assert "τ native" in printed and "drelay ÷ native" in printed
    doc = json.loads((out / "compare.json").read_text())
    assert [v["selector"] for v in doc["variants"]] == ["native", "drelay", "native"]  # default = the trained selector
    m = doc["metrics"]

    # Each number is the replay of that checkpoint over the target's greedy continuations.
    drafter, _, _ = load_drafter(a, tiny)
    enc = HashEncoder(tiny.vocab_size)
    ar = json.loads((out / "cells" / "gsm8k__ar.json").read_text())["outputs"]
    prompts = load_benchmark("gsm8k", limit=2, data_dir=data_dir)
    rounds = committed = 0
    for p in prompts:
        st = replay(tiny, drafter, [enc.encode(p.turns[:1], [])], [ar[p.prompt_id][0]])
        rounds, committed = rounds + st.rounds, committed + st.committed
    assert m["native"]["gsm8k/tau"] == pytest.approx(committed / rounds)
    # A fresh DRelay selector picks exactly the native path: same τ as native selection on its pool.
    for key in ("gsm8k/tau", "mt_bench/tau", "mean_tau", "mean_oracle_tau"):
        assert m["drelay"][key] == m["drelay-native-pick"][key]
    mean = (m["drelay"]["gsm8k/tau"] + m["drelay"]["mt_bench/tau"]) / 2
    assert m["drelay"]["mean_tau"] == pytest.approx(mean)
    assert m["drelay"]["ratio_vs_baseline"] == pytest.approx(mean / m["native"]["mean_tau"])
    assert m["native"]["ratio_vs_baseline"] == 1.0
    assert (out / "compare.png").stat().st_size > 0
    # What each selector costs (batch 1): a rule has no parameters; the trained head's are counted.
    assert m["native"]["params"] == 0 and m["drelay"]["params"] > 0 and m["drelay"]["select_ms"] > 0
    assert "select ms/round" in printed and m["drelay"]["mean_efficiency"] == pytest.approx(
        m["drelay"]["mean_tau"] / m["drelay"]["mean_oracle_tau"]
    )

    client = get_client()
    run = client.search_runs([client.get_experiment_by_name("drelay-compare").experiment_id])[0]
    assert run.info.status == "FINISHED" and run.data.metrics["drelay/mean_tau"] == pytest.approx(mean)
    assert {f.path for f in client.list_artifacts(run.info.run_id)} >= {"compare.md", "compare.json", "compare.png"}

    # Rerun: every cell is loaded, nothing is replayed or decoded again.
    def boom(*args, **kwargs):
        raise AssertionError("a finished cell was recomputed")

    monkeypatch.setattr(compare, "replay_cell", boom)
    monkeypatch.setattr("pipelines.eval.runner.decode_pass", boom)
    assert main(_args(data_dir, out, a, b)) == 0
    untimed = lambda metrics: {v: {k: x for k, x in row.items() if k != "select_ms"} for v, row in metrics.items()}  # noqa: E731
    assert untimed(json.loads((out / "compare.json").read_text())["metrics"]) == untimed(m)


@pytest.mark.parametrize(
    "variants, extra, message",
    [
        (["x=/no/such/dir"], [], "checkpoint directory '/no/such/dir' not found"),
        (["nolabel"], [], "expected LABEL=DIR"),
        (["a={a}", "a={b}"], [], "labels must be unique; repeated: a"),
        (["a={a}"], ["--baseline", "zzz"], "--baseline 'zzz' is not a variant label"),
        (["a={a}:magic"], [], "unknown selector 'magic'"),
        (["a={a}:drelay"], [], "holds no trained 'drelay' selector"),
        (["a={a}"], ["--max-new-tokens", "0"], "--max-new-tokens must be"),
        ([], [], "at least one --variant"),
    ],
)
def test_bad_input_is_one_line_and_starts_no_run(uri, data_dir, checkpoints, tmp_path, capsys, variants, extra, message):
    a, b = checkpoints
    args = ["compare", "--target", "tiny-llama", "--data-dir", str(data_dir), "--benchmarks", "gsm8k", "--limit", "1",
            "--max-new-tokens", "6", "--no-progress", "--out", str(tmp_path / "out"), *extra]  # fmt: skip
    for v in variants:
        args += ["--variant", v.format(a=a, b=b)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert get_client().get_experiment_by_name("drelay-compare") is None
    assert not (tmp_path / "out" / "compare.json").exists()


def test_corrupted_checkpoint_is_a_clear_error(data_dir, checkpoints, tmp_path, capsys):
    a, _ = checkpoints
    (a / "drafter_config.json").write_text("{not json")
    assert main(["compare", "--no-mlflow", "--variant", f"x={a}", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "drafter_config.json is corrupted" in err and err.count("\n") == 1
