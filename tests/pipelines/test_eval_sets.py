"""The eight benchmark loaders: counts, prompt shape, seeded subsets and user-facing errors."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from drelay_model.errors import DRelayError
from pipelines.data.eval_sets import (
    BENCHMARKS,
    DATA_DIR_ENV,
    HUMANEVAL_TEMPLATE,
    BenchmarkPrompt,
    benchmark_path,
    default_data_dir,
    load_benchmark,
)

EXPECTED_COUNTS = {
    "gsm8k": 1319,
    "math500": 500,
    "aime25": 30,
    "humaneval": 164,
    "mbpp": 500,
    "livecodebench": 279,
    "mt_bench": 80,
    "alpaca": 805,
}


def _write_jsonl(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_names_are_the_papers_eight_in_order() -> None:
    assert BENCHMARKS == tuple(EXPECTED_COUNTS)


def test_repo_data_dir_has_every_file_and_sources() -> None:
    root = default_data_dir()
    assert (root / "SOURCES.md").is_file()
    for name in BENCHMARKS:
        assert benchmark_path(name).is_file(), name


@pytest.mark.parametrize("name", BENCHMARKS)
def test_loader_returns_well_formed_prompts(name: str) -> None:
    prompts = load_benchmark(name)
    assert len(prompts) == EXPECTED_COUNTS[name]
    ids = [p.prompt_id for p in prompts]
    assert len(set(ids)) == len(ids)
    n_turns = 2 if name == "mt_bench" else 1
    for p in prompts:
        assert isinstance(p, BenchmarkPrompt) and p.benchmark == name
        assert isinstance(p.prompt_id, str) and p.prompt_id
        assert len(p.turns) == n_turns and len(p.raw) == n_turns
        assert all(isinstance(t, str) and t.strip() for t in p.turns + p.raw)


@pytest.mark.parametrize("name", ["gsm8k", "math500", "aime25"])
def test_math_prompts_ask_for_a_boxed_answer(name: str) -> None:
    for p in load_benchmark(name):
        assert p.turns[0].startswith(p.raw[0].strip())
        assert p.turns[0].endswith("put your final answer within \\boxed{}.")


def test_code_prompts_carry_stub_tests_and_starter_code() -> None:
    for p in load_benchmark("humaneval"):
        assert p.prompt_id.startswith("HumanEval/") and p.raw[0] in p.turns[0]
        assert "```python\n" in p.turns[0] and p.turns[0].endswith("```")
    mbpp = load_benchmark("mbpp")
    assert {int(p.prompt_id) for p in mbpp} == set(range(11, 511))
    for p in mbpp:
        assert p.raw[0].strip() in p.turns[0] and p.turns[0].count("assert ") >= 1
    lcb = load_benchmark("livecodebench")
    with_starter = [p for p in lcb if "Use the following starter code" in p.turns[0]]
    assert 0 < len(with_starter) < len(lcb)
    assert all("```python\n" in p.turns[0] for p in with_starter)


def test_chat_prompts_are_used_verbatim() -> None:
    for p in load_benchmark("alpaca"):
        assert p.turns == p.raw
    first = load_benchmark("mt_bench")[0]
    assert first.prompt_id == "81" and first.turns == first.raw


def test_humaneval_template_keeps_the_stub_verbatim() -> None:
    stub = 'def f(x):\n    """Return x."""\n'
    assert f"```python\n{stub}```" in HUMANEVAL_TEMPLATE.format(prompt=stub)


def test_limit_is_a_seeded_stable_subset() -> None:
    full = load_benchmark("gsm8k")
    position = {p.prompt_id: i for i, p in enumerate(full)}
    a = load_benchmark("gsm8k", limit=25, seed=3)
    assert a == load_benchmark("gsm8k", limit=25, seed=3)
    assert len(a) == 25
    idx = [position[p.prompt_id] for p in a]
    assert idx == sorted(idx)  # file order
    assert a != load_benchmark("gsm8k", limit=25, seed=4)
    small = load_benchmark("gsm8k", limit=10, seed=3)
    assert {p.prompt_id for p in small} <= {p.prompt_id for p in a}  # nested subsets
    assert load_benchmark("aime25", limit=1000) == load_benchmark("aime25")


@pytest.mark.parametrize("limit", [0, -3, True, 2.5])
def test_bad_limit_is_rejected(limit: object) -> None:
    with pytest.raises(DRelayError, match="limit"):
        load_benchmark("aime25", limit=limit)  # type: ignore[arg-type]


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(DRelayError) as err:
        load_benchmark("gsm9k")
    message = str(err.value)
    assert "\n" not in message and "gsm9k" in message
    assert all(name in message for name in BENCHMARKS)


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(DRelayError) as err:
        load_benchmark("math500", data_dir=tmp_path)
    assert str(tmp_path / "math500" / "test.jsonl") in str(err.value)


@pytest.mark.parametrize(
    ("name", "relpath", "content"),
    [
        ("gsm8k", "gsm8k/test.jsonl", ""),
        ("gsm8k", "gsm8k/test.jsonl", "\n\n"),
        ("livecodebench", "livecodebench/livecodebench_v5_2408_2502.json", "[]"),
        ("livecodebench", "livecodebench/livecodebench_v5_2408_2502.json", ""),
    ],
)
def test_empty_file_names_the_path(tmp_path: Path, name: str, relpath: str, content: str) -> None:
    path = tmp_path / relpath
    path.parent.mkdir(parents=True)
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DRelayError, match="no .* prompts in") as err:
        load_benchmark(name, data_dir=tmp_path)
    assert str(path) in str(err.value)


def test_mbpp_file_without_test_split_is_empty(tmp_path: Path) -> None:
    row = {"task_id": 600, "text": "t", "code": "pass", "test_list": ["assert True"]}
    _write_jsonl(tmp_path / "mbpp" / "mbpp.jsonl", [json.dumps(row)])
    with pytest.raises(DRelayError, match="no mbpp prompts"):
        load_benchmark("mbpp", data_dir=tmp_path)


@pytest.mark.parametrize(
    ("bad_line", "what"),
    [
        ("{not json", "not valid JSON"),
        ('["a", "list"]', "expected a JSON object"),
        ('{"answer": "#### 1"}', "'question'"),
        ('{"question": 7}', "'question'"),
        ('{"question": "   "}', "empty"),
    ],
)
def test_malformed_row_names_file_and_line(tmp_path: Path, bad_line: str, what: str) -> None:
    good = json.dumps({"question": "What is 1+1?", "answer": "#### 2"})
    path = _write_jsonl(tmp_path / "gsm8k" / "test.jsonl", [good, "", bad_line])
    with pytest.raises(DRelayError) as err:
        load_benchmark("gsm8k", data_dir=tmp_path)
    assert f"{path}:3" in str(err.value) and what in str(err.value)


def test_malformed_rows_in_other_formats(tmp_path: Path) -> None:
    lcb = tmp_path / "livecodebench" / "livecodebench_v5_2408_2502.json"
    lcb.parent.mkdir(parents=True)
    lcb.write_text(json.dumps([{"problem": "p", "starter_code": ""}, {"starter_code": ""}]))
    with pytest.raises(DRelayError, match=r"\[1\].*'problem'"):
        load_benchmark("livecodebench", data_dir=tmp_path)
    mt = {"question_id": 1, "category": "x", "turns": ["ok", 3]}
    _write_jsonl(tmp_path / "mt_bench" / "question.jsonl", [json.dumps(mt)])
    with pytest.raises(DRelayError, match=r"question.jsonl:1: field 'turns'"):
        load_benchmark("mt_bench", data_dir=tmp_path)
    mbpp = {"task_id": 11, "text": "t", "code": "pass", "test_list": "assert True"}
    _write_jsonl(tmp_path / "mbpp" / "mbpp.jsonl", [json.dumps(mbpp)])
    with pytest.raises(DRelayError, match=r"mbpp.jsonl:1: field 'test_list'"):
        load_benchmark("mbpp", data_dir=tmp_path)


def test_unreadable_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "humaneval" / "HumanEval.jsonl.gz"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not gzip at all")
    with pytest.raises(DRelayError, match="cannot be read") as err:
        load_benchmark("humaneval", data_dir=tmp_path)
    assert str(path) in str(err.value)


def test_duplicate_ids_are_rejected(tmp_path: Path) -> None:
    row = json.dumps({"id": "a", "problem": "p", "answer": "1"})
    _write_jsonl(tmp_path / "aime25" / "test.jsonl", [row, row])
    with pytest.raises(DRelayError, match="duplicate aime25 prompt id 'a'"):
        load_benchmark("aime25", data_dir=tmp_path)


def test_env_var_points_at_another_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n"} for i in range(3)]
    path = tmp_path / "humaneval" / "HumanEval.jsonl.gz"
    path.parent.mkdir(parents=True)
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    assert default_data_dir() == tmp_path
    prompts = load_benchmark("humaneval")
    assert [p.prompt_id for p in prompts] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
