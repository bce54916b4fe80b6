"""`make demo` decodes a held-out prompt: a GSM8K test question that occurs in no file the training
corpus reads — the target-regenerated conversations the drafter trains on and the source corpora
they were regenerated from (GSM8K train, Alpaca 5k, MBPP train, FastChat) — neither whole nor in
part: no run of `RUN` consecutive words of it (lower case, whitespace collapsed) is in any string of
those files, so a reworded training question fails too."""

from __future__ import annotations

import json
import re
from functools import lru_cache
from collections.abc import Iterator
from pathlib import Path

from pipelines.common.paths import REPO_ROOT, repo_path
from pipelines.data.corpora import DEFAULT_TRAIN_SOURCES, normalize_text, source_file
from pipelines.data.eval_sets import default_data_dir
from pipelines.data.stored_jsonl import read_text
from pipelines.train.config import DataSection
from pipelines.train.data import data_files

RUN = 8  # words


def demo_message() -> str:
    match = re.search(r"^DEMO_MESSAGE \?= (.+)$", (REPO_ROOT / "Makefile").read_text(), flags=re.MULTILINE)
    assert match, "Makefile: no DEMO_MESSAGE"
    return match.group(1).strip()


def strings(node) -> Iterator[str]:
    """Every string value (and key) in a parsed JSON document."""
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for key, value in node.items():
            yield key
            yield from strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from strings(value)


def documents(path: Path) -> Iterator[object]:
    """The JSON records of a `.json` array or a (compressed) JSONL file."""
    text = read_text(path)
    if path.name.endswith(".json"):
        yield json.loads(text)
        return
    for line in text.split("\n"):
        if line.strip():
            yield json.loads(line)


def training_files() -> list[Path]:
    regenerated = data_files(repo_path(DataSection().regenerated))  # the default `data.regenerated` glob
    return [*regenerated, *(source_file(name) for name in DEFAULT_TRAIN_SOURCES)]


def test_the_demo_prompt_is_a_gsm8k_test_question():
    test_questions = {
        normalize_text(json.loads(line)["question"]) for line in (default_data_dir() / "gsm8k" / "test.jsonl").open()
    }
    assert normalize_text(demo_message()) in test_questions


def word_runs(text: str, n: int = RUN) -> set[str]:
    words = normalize_text(text).split()  # lower case, whitespace collapsed
    return {" ".join(words[i : i + n]) for i in range(len(words) - n + 1)}


@lru_cache(maxsize=None)
def normalized_strings(path: Path) -> tuple[str, ...]:
    return tuple(normalize_text(text) for doc in documents(path) for text in strings(doc))


def occurrences(prompt: str, path: Path) -> list[str]:
    """The strings of `path` (normalised) that hold `prompt` or a run of `RUN` of its words."""
    runs = word_runs(prompt)
    return [text for text in normalized_strings(path) if any(run in text for run in runs)]


def test_the_demo_prompt_is_in_no_training_file():
    files = training_files()
    assert any(".jsonl" in f.name for f in files) and len(files) >= len(DEFAULT_TRAIN_SOURCES) + 1
    prompt = demo_message()
    assert len(word_runs(prompt)) > 0
    for path in files:
        hits = occurrences(prompt, path)
        assert not hits, f"make demo's prompt occurs in {path}: {hits[0][:120]!r}"


def test_a_reworded_training_question_is_caught():
    """GSM8K train example 1, reworded at its end: in the GSM8K training file and in the target's
    regenerated answers to it."""
    reworded = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did she sell altogether?"
    files = training_files()
    assert occurrences(reworded, source_file("gsm8k_train"))
    assert any(occurrences(reworded, path) for path in files if "regenerated" in str(path))
