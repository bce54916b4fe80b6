"""Training conversations for the drafter: the CPU-default corpus and user ShareGPT files.

Why here: the drafter is trained on chat conversations rendered with the target's chat template;
each source's rows are turned into `{"role", "content"}` messages once, in one place, with the
same instruction templates the benchmarks use (so the prompts the drafter sees in training look
like the ones it is evaluated on). The assistant turns are the datasets' reference answers;
training normally replaces them with the target's own greedy generations.

Never train on evaluation prompts: `load_training_corpus` drops every conversation whose raw
prompt or user message equals (case- and whitespace-insensitively) a prompt of one of the eight
benchmarks (`find_eval_overlaps`). Sources and licenses: `data/train/SOURCES.md`.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from drelay_model.errors import DRelayError
from pipelines.common.paths import REPO_ROOT
from pipelines.data.eval_sets import (
    BENCHMARKS,
    MATH_TEMPLATE,
    MBPP_TEMPLATE,
    MBPP_TEST_IDS,
    Row,
    default_data_dir,
    id_field,
    load_benchmark,
    read_rows,
    text_field,
)

logger = logging.getLogger(__name__)

DEFAULT_TRAIN_SOURCES: tuple[str, ...] = ("gsm8k_train", "alpaca5k", "mbpp_train", "fastchat")
"""The CPU default's training corpus (~13k conversations), in load order."""

TRAIN_DIR_ENV = "DRELAY_TRAIN_DIR"
"""Environment variable naming a training-data directory to use instead of the repo's copy."""

# ShareGPT speaker names -> chat roles. "messages"-style files use the role names directly.
SHAREGPT_ROLES: dict[str, str] = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "assistant": "assistant",
    "system": "system",
}

_CALCULATOR = re.compile(r"<<[^<>]*>>")  # GSM8K calculator annotations, e.g. <<16-3-4=9>>
# Alpaca "input" placeholders ("<noinput>", "N/A", "No input required." ...), letters only.
_NO_INPUT = {"noinput", "ninput", "none", "na", "noinputneeded", "noinputrequired"}


@dataclass(frozen=True)
class Conversation:
    """One training conversation.

    `messages` are `{"role": "user"|"assistant"|"system", "content": str}` dicts, ready for
    `tokenizer.apply_chat_template`; the first non-system message is from the user and the last
    from the assistant. `raw_prompts` are the untemplated problem texts the user message was
    built from (e.g. the GSM8K question); they, together with every user message, are what the
    evaluation-overlap check compares. `conv_id` is unique within `source` (a cache key).
    """

    source: str
    conv_id: str
    messages: tuple[dict[str, str], ...]
    raw_prompts: tuple[str, ...] = ()


@dataclass(frozen=True)
class Overlap:
    """A training conversation that contains an evaluation prompt."""

    source: str
    conv_id: str
    benchmark: str
    prompt_id: str
    text: str


def default_train_dir() -> Path:
    """`$DRELAY_TRAIN_DIR`, else the repo's `data/train` (found relative to this file)."""
    env = os.environ.get(TRAIN_DIR_ENV)
    if env:
        return Path(env).expanduser()
    return REPO_ROOT / "data" / "train"


def normalize_text(text: str) -> str:
    """Lower-case and collapse whitespace: the key under which prompts are compared."""
    return " ".join(text.lower().split())


def _chat(user: str, assistant: str) -> tuple[dict[str, str], ...]:
    return ({"role": "user", "content": user}, {"role": "assistant", "content": assistant})


# --- The built-in sources ------------------------------------------------------------------------


def gsm8k_solution(answer: str, where: str = "answer") -> str:
    """GSM8K reference answer as readable text: calculator annotations removed and the
    `#### N` line rewritten as a sentence with a boxed answer (what the math prompt asks for)."""
    body, sep, final = answer.rpartition("####")
    if not sep or not final.strip():
        raise DRelayError(f"{where}: GSM8K answer has no '#### <number>' final line")
    steps = _CALCULATOR.sub("", body).strip()
    sentence = f"The final answer is $\\boxed{{{final.strip()}}}$."
    return f"{steps}\n{sentence}" if steps else sentence


def _gsm8k_train(rows: list[Row]) -> list[Conversation]:
    out = []
    for i, row in enumerate(rows):
        question = text_field(row, "question")
        answer = gsm8k_solution(text_field(row, "answer"), row.where)
        user = MATH_TEMPLATE.format(problem=question.strip())
        out.append(Conversation("gsm8k_train", str(i), _chat(user, answer), (question,)))
    return out


def is_placeholder_input(text: str) -> bool:
    """True for an empty Alpaca `input` or a stand-in for one ("<noinput>", "N/A", ...)."""
    letters = re.sub(r"[^a-z]", "", text.lower())
    return not text.strip() or (bool(letters) and letters in _NO_INPUT)


def _alpaca5k(rows: list[Row]) -> list[Conversation]:
    out, skipped = [], 0
    for i, row in enumerate(rows):
        instruction = text_field(row, "instruction").strip()
        extra = text_field(row, "input", allow_empty=True).strip()
        output = text_field(row, "output", allow_empty=True).strip()
        if not output:  # two source rows have no response: nothing to learn from
            skipped += 1
            continue
        user = instruction if is_placeholder_input(extra) else f"{instruction}\n\n{extra}"
        out.append(Conversation("alpaca5k", str(i), _chat(user, output), (instruction,)))
    if skipped:
        logger.info("alpaca5k: skipped %d rows with an empty output", skipped)
    return out


def _mbpp_train(rows: list[Row]) -> list[Conversation]:
    out = []
    for row in rows:
        task_id = row.data.get("task_id")
        if isinstance(task_id, bool) or not isinstance(task_id, int):
            raise DRelayError(f"{row.where}: field 'task_id' missing or not an integer")
        if task_id in MBPP_TEST_IDS:  # the evaluation split: never train on it
            continue
        text = text_field(row, "text")
        code = text_field(row, "code").replace("\r\n", "\n").strip()
        tests = row.data.get("test_list")
        if not (isinstance(tests, list) and tests and all(isinstance(t, str) for t in tests)):
            raise DRelayError(f"{row.where}: field 'test_list' missing or not a list of strings")
        user = MBPP_TEMPLATE.format(text=text.strip(), tests="\n".join(tests))
        reply = f"```python\n{code}\n```"
        out.append(Conversation("mbpp_train", str(task_id), _chat(user, reply), (text,)))
    return out


def _fastchat(rows: list[Row]) -> list[Conversation]:
    return parse_sharegpt(rows, source="fastchat")


@dataclass(frozen=True)
class _Source:
    """Where a built-in source's file lives and how its rows become conversations."""

    root: str  # "train" (the training dir) or "benchmarks" (a file shared with an eval set)
    relpath: str
    parse: Callable[[list[Row]], list[Conversation]]


_SOURCES: dict[str, _Source] = {
    "gsm8k_train": _Source("train", "gsm8k/train.jsonl", _gsm8k_train),
    "alpaca5k": _Source("train", "alpaca/alpaca_data_5000_subset_pr152.json", _alpaca5k),
    "mbpp_train": _Source("benchmarks", "mbpp/mbpp.jsonl", _mbpp_train),
    "fastchat": _Source("train", "chat/fastchat_dummy_conversation.json", _fastchat),
}


def source_file(name: str, *, data_dir: str | Path | None = None, benchmarks_dir: str | Path | None = None) -> Path:
    """The file a built-in source is read from: under `data_dir` (default `default_train_dir()`), or
    under `benchmarks_dir` (default `eval_sets.default_data_dir()`) for a file shared with an eval set;
    a `.jsonl` source is read from `X.jsonl.gz` where only that exists."""
    spec = _SOURCES[name]
    if spec.root == "train":
        root = default_train_dir() if data_dir is None else Path(data_dir).expanduser()
    else:
        root = default_data_dir() if benchmarks_dir is None else Path(benchmarks_dir).expanduser()
    path = root / spec.relpath
    packed = path.with_name(path.name + ".gz")  # a JSONL file may be stored gzipped (the bundled GSM8K train set)
    return packed if path.suffix == ".jsonl" and not path.is_file() and packed.is_file() else path


# --- ShareGPT-style files ------------------------------------------------------------------------


def _sharegpt_messages(row: Row) -> list[dict[str, str]]:
    """A record's turns as role/content dicts, from either `conversations` or `messages`."""
    if "conversations" in row.data:
        key, role_key, text_key = "conversations", "from", "value"
    elif "messages" in row.data:
        key, role_key, text_key = "messages", "role", "content"
    else:
        raise DRelayError(f"{row.where}: expected a 'conversations' or 'messages' list")
    turns = row.data[key]
    if not isinstance(turns, list):
        raise DRelayError(f"{row.where}: field {key!r} is not a list")
    messages = []
    for j, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise DRelayError(f"{row.where}: {key}[{j}] is not an object")
        speaker, content = turn.get(role_key), turn.get(text_key)
        role = SHAREGPT_ROLES.get(speaker.lower()) if isinstance(speaker, str) else None
        if role is None:
            raise DRelayError(f"{row.where}: {key}[{j}] has unknown {role_key!r} {speaker!r}")
        if not isinstance(content, str) or not content.strip():
            raise DRelayError(f"{row.where}: {key}[{j}] {text_key!r} missing, empty or not text")
        messages.append({"role": role, "content": content})
    return messages


def _trim_turns(messages: list[dict[str, str]], where: str) -> tuple[dict[str, str], ...]:
    """Keep system prompts, drop assistant turns before the first user turn and user turns after
    the last assistant turn (as FastChat does); require a user turn answered by the assistant."""
    system = [m for m in messages[:1] if m["role"] == "system"]
    rest = messages[len(system):]
    first_user = next((j for j, m in enumerate(rest) if m["role"] == "user"), None)
    last_reply = max((j for j, m in enumerate(rest) if m["role"] == "assistant"), default=None)
    if first_user is None or last_reply is None or last_reply < first_user:
        raise DRelayError(f"{where}: conversation has no user turn followed by an assistant turn")
    return tuple(system + rest[first_user : last_reply + 1])


def load_sharegpt(path: str | Path, *, source: str | None = None) -> list[Conversation]:
    """Read a ShareGPT-style `.json` (array) or `.jsonl` file of conversations.

    Each record has `{"conversations": [{"from": "human"|"gpt"|"system", "value": ...}]}` or
    `{"messages": [{"role": "user"|"assistant"|"system", "content": ...}]}`, and optionally an
    `id` (else the record's index is used). No evaluation-overlap filtering is applied here:
    pass the result to `drop_eval_overlaps` before training on it.

    Args:
        path: the file.
        source: the `Conversation.source` label; default the file name without extension.

    Raises:
        DRelayError: missing or empty file, malformed record (names file and line or item),
            duplicate id.
    """
    path = Path(path).expanduser()
    conversations = parse_sharegpt(list(read_rows(path)), source=source or path.name.split(".")[0])
    if not conversations:
        raise DRelayError(f"no conversations in {path}")
    return conversations


def parse_sharegpt(rows: list[Row], *, source: str) -> list[Conversation]:
    """ShareGPT-style records (see `load_sharegpt`) -> conversations labelled `source`."""
    out: list[Conversation] = []
    seen: set[str] = set()
    for i, row in enumerate(rows):
        conv_id = id_field(row, "id") if "id" in row.data else str(i)
        if conv_id in seen:
            raise DRelayError(f"{row.where}: duplicate conversation id {conv_id!r}")
        seen.add(conv_id)
        messages = _trim_turns(_sharegpt_messages(row), row.where)
        out.append(Conversation(source, conv_id, messages))
    return out


# --- Evaluation overlap ---------------------------------------------------------------------------


def eval_prompt_index(benchmarks_dir: str | Path | None = None) -> dict[str, tuple[str, str]]:
    """Normalised raw text of every evaluation prompt (each MT-Bench turn separately) ->
    (benchmark, prompt_id), over all eight benchmarks."""
    index: dict[str, tuple[str, str]] = {}
    for name in BENCHMARKS:
        for prompt in load_benchmark(name, data_dir=benchmarks_dir):
            for text in prompt.raw + prompt.turns:
                index.setdefault(normalize_text(text), (name, prompt.prompt_id))
    return index


def find_eval_overlaps(
    conversations: Iterable[Conversation], *, benchmarks_dir: str | Path | None = None
) -> list[Overlap]:
    """Conversations whose raw prompt or any user message equals an evaluation prompt.

    Exact match after `normalize_text`; an evaluation prompt is both the raw problem text and
    the templated user turn, so a templated training prompt is caught too.
    """
    index = eval_prompt_index(benchmarks_dir)
    found = []
    for conv in conversations:
        users = [m["content"] for m in conv.messages if m["role"] == "user"]
        for text in (*conv.raw_prompts, *users):
            hit = index.get(normalize_text(text))
            if hit is not None:
                found.append(Overlap(conv.source, conv.conv_id, hit[0], hit[1], text))
                break
    return found


def drop_eval_overlaps(
    conversations: Sequence[Conversation], *, benchmarks_dir: str | Path | None = None
) -> list[Conversation]:
    """`conversations` without those `find_eval_overlaps` reports (logged at WARNING)."""
    overlaps = find_eval_overlaps(conversations, benchmarks_dir=benchmarks_dir)
    for o in overlaps:
        logger.warning(
            "dropping training conversation %s/%s: it equals %s prompt %s",
            o.source, o.conv_id, o.benchmark, o.prompt_id,
        )
    bad = {(o.source, o.conv_id) for o in overlaps}
    return [c for c in conversations if (c.source, c.conv_id) not in bad]


def load_training_corpus(
    names: Sequence[str] = DEFAULT_TRAIN_SOURCES,
    *,
    data_dir: str | Path | None = None,
    benchmarks_dir: str | Path | None = None,
    decontaminate: bool = True,
) -> list[Conversation]:
    """Load and concatenate training sources, minus anything that overlaps the benchmarks.

    Args:
        names: sources from `DEFAULT_TRAIN_SOURCES` (all of them by default).
        data_dir: a directory with the `data/train` layout; default `default_train_dir()`.
        benchmarks_dir: the benchmark directory (MBPP's training ids are read from its
            `mbpp/mbpp.jsonl`, and the overlap check reads all eight benchmarks);
            default `pipelines.data.eval_sets.default_data_dir()`.
        decontaminate: drop conversations that contain an evaluation prompt (keep True
            except to inspect the raw sources).

    Raises:
        DRelayError: unknown or repeated source name, or any file problem (see `read_rows`).
    """
    if isinstance(names, str):
        names = (names,)
    if not names:
        raise DRelayError(f"no training sources given; valid names: {', '.join(_SOURCES)}")
    unknown = [n for n in names if n not in _SOURCES]
    if unknown:
        raise DRelayError(
            f"unknown training source(s) {unknown}; valid names: {', '.join(_SOURCES)}"
        )
    if len(set(names)) != len(names):
        raise DRelayError(f"training sources repeated: {list(names)}")
    bench_dir = default_data_dir() if benchmarks_dir is None else Path(benchmarks_dir).expanduser()
    conversations: list[Conversation] = []
    for name in names:
        path = source_file(name, data_dir=data_dir, benchmarks_dir=bench_dir)
        loaded = _SOURCES[name].parse(list(read_rows(path)))
        if not loaded:
            raise DRelayError(f"no {name} training conversations in {path}")
        conversations.extend(loaded)
    if decontaminate:
        conversations = drop_eval_overlaps(conversations, benchmarks_dir=bench_dir)
    return conversations
