"""Shared fixtures for the pipeline tests: the tiny
target and a two-benchmark prompt folder for the evaluation and comparison tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from drelay_model.target import tiny_target

GSM8K = [{"question": f"Tom has {n} apples and buys {n + 1} more. How many apples does he have?"} for n in range(3)]
MT_BENCH = [
    {"question_id": 81, "turns": ["Write a short travel blog post about Hawaii.", "Rewrite it starting every sentence with A."]},
    {"question_id": 82, "turns": ["Draft an email asking for feedback.", "Now make it shorter."]},
]


@pytest.fixture(scope="module")
def tiny():
    return tiny_target("tiny-llama")


@pytest.fixture
def data_dir(tmp_path) -> Path:
    """gsm8k/test.jsonl (3 prompts) and mt_bench/question.jsonl (2 two-turn conversations)."""
    d = tmp_path / "bench"
    for rel, rows in (("gsm8k/test.jsonl", GSM8K), ("mt_bench/question.jsonl", MT_BENCH)):
        (d / rel).parent.mkdir(parents=True)
        (d / rel).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d
