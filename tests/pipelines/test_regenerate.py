"""`drelay data regenerate`: the target's own greedy answers, exact ids, resume, torn lines, shards,
and the compressed store a finished run leaves (stored_jsonl.py)."""

from __future__ import annotations

import json

import pytest

from drelay_model.decoding import GenerationConfig, SpeculativeEngine
from drelay_model.errors import DRelayError
from drelay_model.target import tiny_target
from pipelines.data.corpora import Conversation
from pipelines.data.regenerate import read_done, regenerate
from pipelines.data.stored_jsonl import read_text


def _records(out):
    """The records of data file `out`, from whichever form holds them."""
    xz = out.with_name(out.name + ".xz")
    return [json.loads(line) for line in read_text(xz if xz.exists() else out).split("\n") if line]


def _conv(source, conv_id, *users):
    msgs = []
    for u in users:
        msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": "reference answer"}]
    return Conversation(source=source, conv_id=conv_id, messages=tuple(msgs))


def test_regenerated_turns_are_the_targets_greedy_tokens(tmp_path, smol):
    convs = [_conv("a", "1", "What is 2+2?"), _conv("b", "1", "Name a colour.", "And another one?")]
    out = tmp_path / "r.jsonl"
    summary = regenerate(smol, convs, out, batch_size=2, decode=GenerationConfig(max_new_tokens=6), progress=False)
    assert summary.generated == 2 and summary.done_before == 0
    assert summary.path == tmp_path / "r.jsonl.xz" and not out.exists()  # a finished run is stored compressed
    records = {(r["source"], r["conv_id"]): r for r in _records(out)}
    assert set(records) == {("a", "1"), ("b", "1")}  # same id in two sources: both kept
    rec = records[("b", "1")]
    assert len(rec["turn_token_ids"]) == 2 and [m["role"] for m in rec["messages"]] == ["user", "assistant"] * 2
    # Turn 2 is conditioned on the regenerated turn 1, and its ids are exactly the target's greedy ones.
    prompt = smol.tokenizer.apply_chat_template(rec["messages"][:3], add_generation_prompt=True, tokenize=True)["input_ids"]
    greedy = SpeculativeEngine(smol).generate([list(prompt)], GenerationConfig(max_new_tokens=6)).tokens[0]
    assert rec["turn_token_ids"][1] == greedy


def test_resume_skips_done_work_and_drops_a_torn_line(tmp_path, smol):
    convs = [_conv("a", str(i), f"Say the number {i}.") for i in range(3)]
    out = tmp_path / "r.jsonl"
    regenerate(smol, convs[:1], out, batch_size=2, decode=GenerationConfig(max_new_tokens=3), progress=False)  # → r.jsonl.xz
    regenerate(smol, convs[1:2], out, batch_size=2, decode=GenerationConfig(max_new_tokens=3), progress=False, compress=False)
    with out.open("a") as f:
        f.write('{"conv_id": "2", "source": "a", "messa')  # a killed writer
    assert read_done(out) == {"a/0", "a/1"} and out.read_text().endswith("\n")  # both forms count
    summary = regenerate(smol, convs, out, batch_size=2, decode=GenerationConfig(max_new_tokens=3), progress=False)
    assert (summary.done_before, summary.generated) == (2, 1)
    assert not out.exists() and [r["conv_id"] for r in _records(out)] == ["0", "1", "2"]


def test_targets_without_a_tokenizer_and_unwritable_paths_are_clear_errors(tmp_path, smol):
    with pytest.raises(DRelayError, match="has no tokenizer"):
        regenerate(tiny_target("tiny-llama"), [_conv("a", "1", "hi")], tmp_path / "r.jsonl", progress=False)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(DRelayError, match="cannot write regenerated data"):
        regenerate(smol, [_conv("a", "1", "hi")], blocker / "r.jsonl", progress=False)


def test_regenerate_takes_target_output_and_budget_from_a_training_config(tmp_path, capsys):
    """The same command for a GPU target: --config supplies target, dtype, output file and the answer
    budget (data.max_seq_len − the prompt budget); --device cuda without CUDA is one line, exit 2."""
    import torch
    import yaml

    from cli import main

    out = tmp_path / "regen.jsonl"
    config = tmp_path / "train.yaml"
    config.write_text(
        yaml.safe_dump({"target": {"spec": "smollm2-135m"}, "data": {"regenerated": str(out), "max_seq_len": 1056}})
    )
    argv = ["data", "regenerate", "--config", str(config), "--sources", "gsm8k_train", "--limit", "1", "--batch-size", "1"]
    assert main([*argv, "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "with smollm2-135m on cpu (float32), ≤ 32 new tokens per answer" in printed
    assert printed.rstrip().endswith(f"→ {out}.xz") and len(_records(out)) == 1
    if not torch.cuda.is_available():
        bad = tmp_path / "bad.jsonl"
        assert main(["data", "regenerate", "--device", "cuda", "--out", str(bad), "--limit", "1"]) == 2
        err = capsys.readouterr().err
        assert "cuda" in err and err.count("\n") == 1 and not bad.exists()
