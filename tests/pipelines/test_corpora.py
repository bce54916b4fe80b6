"""Training corpora: the default sources, ShareGPT files, errors, and no overlap with evaluation."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from drelay_model.errors import DRelayError
from pipelines.data.eval_sets import BENCHMARKS, load_benchmark
from pipelines.data.corpora import (
    DEFAULT_TRAIN_SOURCES,
    Conversation,
    default_train_dir,
    find_eval_overlaps,
    gsm8k_solution,
    is_placeholder_input,
    load_sharegpt,
    load_training_corpus,
)

EXPECTED = {"gsm8k_train": 7473, "alpaca5k": 4997, "mbpp_train": 471, "fastchat": 500}
# Exact duplicates of evaluation prompts found in the source files (see data/train/SOURCES.md).
KNOWN_OVERLAPS = {
    ("alpaca5k", "3336", "mt_bench", "99"),
    ("mbpp_train", "602", "mbpp", "217"),
    ("mbpp_train", "704", "mbpp", "248"),
    ("mbpp_train", "872", "mbpp", "216"),
}
MBPP_TRAIN_IDS = set(range(1, 11)) | set(range(511, 975))


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


@pytest.fixture(scope="module")
def corpus() -> list[Conversation]:
    return load_training_corpus()


@pytest.fixture(scope="module")
def eval_texts() -> set[str]:
    """Every evaluation prompt's raw problem text and templated turn, normalised."""
    return {_norm(text) for name in BENCHMARKS for p in load_benchmark(name) for text in p.raw + p.turns}


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_repo_train_dir_has_sources() -> None:
    assert (default_train_dir() / "SOURCES.md").is_file()
    assert DEFAULT_TRAIN_SOURCES == tuple(EXPECTED)


def test_default_corpus_counts_and_shape(corpus: list[Conversation]) -> None:
    assert Counter(c.source for c in corpus) == EXPECTED
    assert len({(c.source, c.conv_id) for c in corpus}) == len(corpus)
    for c in corpus:
        roles = [m["role"] for m in c.messages]
        assert set(roles) <= {"system", "user", "assistant"}
        assert [r for r in roles if r != "system"][0] == "user" and roles[-1] == "assistant"
        assert all(set(m) == {"role", "content"} for m in c.messages)
        assert all(isinstance(m["content"], str) and m["content"].strip() for m in c.messages)


def test_gsm8k_answers_are_readable(corpus: list[Conversation]) -> None:
    gsm = [c for c in corpus if c.source == "gsm8k_train"]
    for c in gsm:
        answer = c.messages[-1]["content"]
        assert "<<" not in answer and "####" not in answer
        assert answer.splitlines()[-1].startswith("The final answer is $\\boxed{")
        assert "\\boxed{}" in c.messages[0]["content"]
    assert gsm8k_solution("So 9*2=<<9*2=18>>18 dollars.\n#### 18") == ("So 9*2=18 dollars.\nThe final answer is $\\boxed{18}$.")
    with pytest.raises(DRelayError, match="####"):
        gsm8k_solution("no final line")


def test_mbpp_train_uses_only_non_test_ids(corpus: list[Conversation]) -> None:
    ids = {int(c.conv_id) for c in corpus if c.source == "mbpp_train"}
    assert ids == MBPP_TRAIN_IDS - {602, 704, 872}
    assert not ids & set(range(11, 511))
    sample = next(c for c in corpus if c.source == "mbpp_train")
    assert "assert " in sample.messages[0]["content"]
    assert sample.messages[-1]["content"].startswith("```python\n")


def test_alpaca_user_message_is_instruction_plus_input(corpus: list[Conversation]) -> None:
    rows = json.loads((default_train_dir() / "alpaca" / "alpaca_data_5000_subset_pr152.json").read_text("utf-8"))
    for c in corpus:
        if c.source != "alpaca5k":
            continue
        row = rows[int(c.conv_id)]
        assert c.messages[0]["content"].startswith(row["instruction"].strip())
        if is_placeholder_input(row["input"]):
            assert c.messages[0]["content"] == row["instruction"].strip()
        else:
            assert c.messages[0]["content"].endswith("\n\n" + row["input"].strip())
        assert c.messages[1]["content"] == row["output"].strip()
    assert all(map(is_placeholder_input, ["", " <noinput> ", "N/A", "No input required."]))
    assert not any(map(is_placeholder_input, ["Banana", "input: 2", "x = 3", "42", "[1, 2]", "+"]))


def test_training_corpus_does_not_contain_evaluation_prompts(corpus: list[Conversation], eval_texts: set[str]) -> None:
    leaks = [
        (c.source, c.conv_id, text[:80])
        for c in corpus
        for text in (*c.raw_prompts, *(m["content"] for m in c.messages if m["role"] == "user"))
        if _norm(text) in eval_texts
    ]
    assert leaks == []


def test_source_splits_are_disjoint(corpus: list[Conversation]) -> None:
    def raw(source: str) -> set[str]:
        return {_norm(t) for c in corpus if c.source == source for t in c.raw_prompts}

    assert not raw("gsm8k_train") & {_norm(p.raw[0]) for p in load_benchmark("gsm8k")}
    assert not raw("mbpp_train") & {_norm(p.raw[0]) for p in load_benchmark("mbpp")}
    assert not raw("alpaca5k") & {_norm(p.raw[0]) for p in load_benchmark("alpaca")}


def test_the_raw_sources_hold_exactly_the_known_overlaps(corpus: list[Conversation]) -> None:
    raw = load_training_corpus(decontaminate=False)
    found = {(o.source, o.conv_id, o.benchmark, o.prompt_id) for o in find_eval_overlaps(raw)}
    assert found == KNOWN_OVERLAPS
    assert len(raw) - len(corpus) == len(KNOWN_OVERLAPS)


def test_sharegpt_both_formats(tmp_path: Path) -> None:
    sharegpt = [
        {
            "id": "a",
            "conversations": [
                {"from": "gpt", "value": "leading reply, dropped"},
                {"from": "human", "value": "hi"},
                {"from": "gpt", "value": "hello"},
                {"from": "human", "value": "unanswered, dropped"},
            ],
        },
        {
            "conversations": [
                {"from": "system", "value": "be brief"},
                {"from": "human", "value": "q"},
                {"from": "gpt", "value": "a"},
            ]
        },
    ]
    convs = load_sharegpt(_write(tmp_path / "chats.json", json.dumps(sharegpt)))
    assert [c.conv_id for c in convs] == ["a", "1"] and convs[0].source == "chats"
    assert convs[0].messages == (
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    )
    assert [m["role"] for m in convs[1].messages] == ["system", "user", "assistant"]
    messages = {"id": 7, "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}
    jsonl = _write(tmp_path / "more.jsonl", json.dumps(messages) + "\n")
    (conv,) = load_sharegpt(jsonl, source="mine")
    assert (conv.source, conv.conv_id, len(conv.messages)) == ("mine", "7", 2)


@pytest.mark.parametrize(
    ("record", "what"),
    [
        ({"conversations": [{"from": "alien", "value": "x"}]}, "unknown 'from'"),
        ({"conversations": [{"from": "human", "value": ""}]}, "empty"),
        ({"conversations": [{"from": "human", "value": "only a question"}]}, "no user turn"),
        ({"text": "no turns"}, "'conversations' or 'messages'"),
        ({"messages": "not a list"}, "not a list"),
    ],
)
def test_sharegpt_malformed_record_names_file_and_line(tmp_path: Path, record: dict, what: str) -> None:
    good = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    path = _write(tmp_path / "c.jsonl", f"{json.dumps(good)}\n{json.dumps(record)}\n")
    with pytest.raises(DRelayError) as err:
        load_sharegpt(path)
    assert f"{path}:2" in str(err.value) and what in str(err.value)


def test_sharegpt_file_errors(tmp_path: Path) -> None:
    with pytest.raises(DRelayError, match="not found"):
        load_sharegpt(tmp_path / "missing.json")
    empty = _write(tmp_path / "empty.json", "[]")
    with pytest.raises(DRelayError, match=f"no conversations in {empty}"):
        load_sharegpt(empty)
    conv = {"id": "x", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    dup = _write(tmp_path / "dup.json", json.dumps([conv, conv]))
    with pytest.raises(DRelayError, match=r"dup.json\[1\]: duplicate conversation id 'x'"):
        load_sharegpt(dup)


def test_unknown_or_repeated_source_names() -> None:
    with pytest.raises(DRelayError) as err:
        load_training_corpus(["gsm8k_train", "sharegpt"])
    assert "sharegpt" in str(err.value)
    assert all(name in str(err.value) for name in DEFAULT_TRAIN_SOURCES)
    with pytest.raises(DRelayError, match="repeated"):
        load_training_corpus(["fastchat", "fastchat"])
    with pytest.raises(DRelayError, match="no training sources"):
        load_training_corpus([])


def test_training_file_errors(tmp_path: Path) -> None:
    with pytest.raises(DRelayError, match=str(tmp_path / "gsm8k" / "train.jsonl")):
        load_training_corpus(["gsm8k_train"], data_dir=tmp_path)
    path = _write(tmp_path / "gsm8k" / "train.jsonl", "")
    with pytest.raises(DRelayError, match=f"no gsm8k_train training conversations in {path}"):
        load_training_corpus(["gsm8k_train"], data_dir=tmp_path)
    good = json.dumps({"question": "q?", "answer": "1+1=<<1+1=2>>2\n#### 2"})
    _write(path, f"{good}\n{json.dumps({'question': 'q2?', 'answer': 'no final line'})}\n")
    with pytest.raises(DRelayError, match=f"{path}:2: GSM8K answer"):
        load_training_corpus(["gsm8k_train"], data_dir=tmp_path)
    _write(path, good + "\n")
    (conv,) = load_training_corpus(["gsm8k_train"], data_dir=tmp_path)
    assert conv.messages[-1]["content"] == "1+1=2\nThe final answer is $\\boxed{2}$."
