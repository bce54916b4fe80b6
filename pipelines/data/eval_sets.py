"""The eight evaluation benchmarks behind one loader, `load_benchmark(name)`.

Why one interface: speedup S and acceptance τ are reported per benchmark, and every decoding
method must see byte-identical prompts, so prompt construction lives here and nowhere else.
Each benchmark's raw problem is wrapped in a short instruction for a chat model (the templates
below); callers apply the target's chat template to `turns`.

Data: by default the repo's `data/benchmarks/` (see its SOURCES.md for origin and license),
overridable per call (`data_dir=`) or by the `DRELAY_DATA_DIR` environment variable; any
directory with the same file layout works (e.g. a full LiveCodeBench release).
"""

from __future__ import annotations

import gzip
import json
import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from drelay_model.errors import DRelayError
from pipelines.common.paths import REPO_ROOT

# The paper's order; also the order of tables and MLflow metrics.
BENCHMARKS: tuple[str, ...] = (
    "gsm8k",
    "math500",
    "aime25",
    "humaneval",
    "mbpp",
    "livecodebench",
    "mt_bench",
    "alpaca",
)

DATA_DIR_ENV = "DRELAY_DATA_DIR"
"""Environment variable naming a benchmark directory to use instead of the repo's copy."""

MBPP_TEST_IDS = range(11, 511)
"""MBPP's test split (task ids 11..510); ids 1..10 and 511..974 are training data."""

# --- Prompt templates (str.format fields in braces; literal braces doubled) --------------------

MATH_TEMPLATE = "{problem}\n\nPlease reason step by step, and put your final answer within \\boxed{{}}."
"""GSM8K, MATH-500 and AIME25: the problem, then the usual zero-shot chain-of-thought request
with a `\\boxed{}` final answer (the convention of Qwen-style math evals)."""

HUMANEVAL_TEMPLATE = (
    "Complete the following Python function. Reply with the complete function, including its "
    "signature and any imports it needs, in a single ```python code block.\n\n"
    "```python\n{prompt}```"
)
"""HumanEval: the function signature + docstring (the `prompt` field, kept verbatim, it ends in a
newline) inside a code block, with a request to complete it."""

MBPP_TEMPLATE = (
    "You are an expert Python programmer, and here is your task: {text}\n"
    "Your code should pass these tests:\n\n{tests}\n\n"
    "Write your solution in a single ```python code block."
)
"""MBPP: the task text plus its three test asserts, in the original MBPP paper's wording (also
used by SpecForge/DFlash-style evals), asking for a code block instead of `[BEGIN]`/`[DONE]`."""

LIVECODEBENCH_STARTER_TEMPLATE = (
    "You will be given a programming problem. Write a correct Python program that meets the "
    "specification and passes all tests.\n\nQuestion: {problem}\n\n"
    "Use the following starter code and put your solution in a single ```python code block.\n"
    "```python\n{starter_code}\n```"
)
"""LiveCodeBench problems with starter code (LeetCode-style functional problems)."""

LIVECODEBENCH_STDIN_TEMPLATE = (
    "You will be given a programming problem. Write a correct Python program that meets the "
    "specification and passes all tests.\n\nQuestion: {problem}\n\n"
    "Read the input from standard input and write the answer to standard output. Put your "
    "solution in a single ```python code block."
)
"""LiveCodeBench problems without starter code (stdin/stdout problems, AtCoder/Codeforces)."""

# MT-Bench turns and AlpacaEval instructions are used as-is: they are already chat requests.


@dataclass(frozen=True)
class BenchmarkPrompt:
    """One evaluation item.

    `turns` are the user messages to send. MT-Bench has two; the caller sends the second after
    the model's own answer to the first. All other benchmarks have one. `raw` holds the
    untemplated problem text of each turn (question, problem, function stub, task text, ...):
    it is what training data is checked against so that no evaluation prompt is trained on.
    """

    benchmark: str
    prompt_id: str
    turns: tuple[str, ...]
    raw: tuple[str, ...]


@dataclass(frozen=True)
class Row:
    """One parsed record of a data file and where it came from (for error messages)."""

    data: dict[str, Any]
    where: str  # "path:line" for JSONL, "path[item]" for a JSON array


def default_data_dir() -> Path:
    """The benchmark directory used when none is given: `$DRELAY_DATA_DIR`, else the repo's copy.

    The repo copy is found relative to this file (`<repo>/data/benchmarks`), so it works from a
    source checkout or an editable install; other installs set the environment variable.
    """
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        return Path(env).expanduser()
    return REPO_ROOT / "data" / "benchmarks"


def read_rows(path: Path) -> Iterator[Row]:
    """Yield the JSON objects of a `.jsonl`, `.jsonl.gz` or `.json` (array) file.

    Raises DRelayError naming the path for a missing file and naming path and line (or array
    item) for a record that is not valid JSON or not a JSON object.
    """
    if not path.is_file():
        raise DRelayError(f"data file not found: {path}")
    name = path.name
    if name.endswith(".json"):
        try:
            text = path.read_text(encoding="utf-8")
            items = json.loads(text) if text.strip() else []
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise DRelayError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(items, list):
            raise DRelayError(f"{path}: expected a JSON array of objects")
        for i, item in enumerate(items):
            yield _as_row(item, f"{path}[{i}]")
        return
    opener = gzip.open if name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    item = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DRelayError(f"{where}: not valid JSON ({exc.msg})") from None
                yield _as_row(item, where)
    except (OSError, UnicodeDecodeError) as exc:  # e.g. a corrupt .gz or a binary file
        raise DRelayError(f"{path}: cannot be read as UTF-8 JSON lines ({exc})") from None


def _as_row(item: object, where: str) -> Row:
    if not isinstance(item, dict):
        raise DRelayError(f"{where}: expected a JSON object, got {type(item).__name__}")
    return Row(item, where)


def text_field(row: Row, key: str, *, allow_empty: bool = False) -> str:
    """`row.data[key]` as a string; DRelayError naming file and line if missing or wrong type."""
    value = row.data.get(key)
    if not isinstance(value, str):
        raise DRelayError(f"{row.where}: field {key!r} missing or not a string")
    if not allow_empty and not value.strip():
        raise DRelayError(f"{row.where}: field {key!r} is empty")
    return value


def id_field(row: Row, key: str) -> str:
    """An id field (string or integer) as a string; DRelayError naming file and line otherwise."""
    value = row.data.get(key)
    if isinstance(value, bool) or not isinstance(value, (str, int)) or str(value) == "":
        raise DRelayError(f"{row.where}: field {key!r} missing or not a string/integer id")
    return str(value)


# --- Per-benchmark parsers: rows of the file -> prompts ------------------------------------------


Parser = Callable[[list[Row]], list[BenchmarkPrompt]]


def _math_rows(name: str, problem_key: str, id_key: str | None) -> Parser:
    """Parser for GSM8K / MATH-500 / AIME25 style rows (one problem field, optional id field)."""

    def parse(rows: list[Row]) -> list[BenchmarkPrompt]:
        out = []
        for i, row in enumerate(rows):
            problem = text_field(row, problem_key)
            pid = id_field(row, id_key) if id_key else str(i)
            turn = MATH_TEMPLATE.format(problem=problem.strip())
            out.append(BenchmarkPrompt(name, pid, (turn,), (problem,)))
        return out

    return parse


def _humaneval(rows: list[Row]) -> list[BenchmarkPrompt]:
    out = []
    for row in rows:
        stub = text_field(row, "prompt")
        turn = HUMANEVAL_TEMPLATE.format(prompt=stub if stub.endswith("\n") else stub + "\n")
        out.append(BenchmarkPrompt("humaneval", id_field(row, "task_id"), (turn,), (stub,)))
    return out


def _mbpp(rows: list[Row]) -> list[BenchmarkPrompt]:
    out = []
    for row in rows:
        task_id = row.data.get("task_id")
        if isinstance(task_id, bool) or not isinstance(task_id, int):
            raise DRelayError(f"{row.where}: field 'task_id' missing or not an integer")
        if task_id not in MBPP_TEST_IDS:
            continue
        text = text_field(row, "text")
        tests = row.data.get("test_list")
        if not (isinstance(tests, list) and tests and all(isinstance(t, str) for t in tests)):
            raise DRelayError(f"{row.where}: field 'test_list' missing or not a list of strings")
        turn = MBPP_TEMPLATE.format(text=text.strip(), tests="\n".join(tests))
        out.append(BenchmarkPrompt("mbpp", str(task_id), (turn,), (text,)))
    return out


def _livecodebench(rows: list[Row]) -> list[BenchmarkPrompt]:
    out = []
    for i, row in enumerate(rows):
        problem = text_field(row, "problem")
        text = problem.replace("\r\n", "\n").strip()  # some AtCoder statements use CRLF
        has_starter = "starter_code" in row.data
        starter = text_field(row, "starter_code", allow_empty=True) if has_starter else ""
        if starter.strip():
            turn = LIVECODEBENCH_STARTER_TEMPLATE.format(problem=text, starter_code=starter.rstrip())
        else:
            turn = LIVECODEBENCH_STDIN_TEMPLATE.format(problem=text)
        out.append(BenchmarkPrompt("livecodebench", str(i), (turn,), (problem,)))
    return out


def _mt_bench(rows: list[Row]) -> list[BenchmarkPrompt]:
    out = []
    for row in rows:
        turns = row.data.get("turns")
        if not (isinstance(turns, list) and turns and all(_nonempty_str(t) for t in turns)):
            raise DRelayError(f"{row.where}: field 'turns' missing or not non-empty strings")
        pid = id_field(row, "question_id")
        out.append(BenchmarkPrompt("mt_bench", pid, tuple(turns), tuple(turns)))
    return out


def _nonempty_str(value: object) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _alpaca(rows: list[Row]) -> list[BenchmarkPrompt]:
    out = []
    for i, row in enumerate(rows):
        instruction = text_field(row, "instruction")
        pid = id_field(row, "idx") if "idx" in row.data else str(i)
        out.append(BenchmarkPrompt("alpaca", pid, (instruction,), (instruction,)))
    return out


# name -> (file relative to the data dir, parser). Explicit, built at import with no I/O.
_SPECS: dict[str, tuple[str, Parser]] = {
    "gsm8k": ("gsm8k/test.jsonl", _math_rows("gsm8k", "question", None)),
    "math500": ("math500/test.jsonl", _math_rows("math500", "problem", "unique_id")),
    "aime25": ("aime25/test.jsonl", _math_rows("aime25", "problem", "id")),
    "humaneval": ("humaneval/HumanEval.jsonl.gz", _humaneval),
    "mbpp": ("mbpp/mbpp.jsonl", _mbpp),
    "livecodebench": ("livecodebench/livecodebench_v5_2408_2502.json", _livecodebench),
    "mt_bench": ("mt_bench/question.jsonl", _mt_bench),
    "alpaca": ("alpaca_eval/alpaca_eval_prompts.jsonl", _alpaca),
}


def benchmark_path(name: str, data_dir: str | Path | None = None) -> Path:
    """The prompt file `load_benchmark(name)` reads; DRelayError for an unknown name."""
    if name not in _SPECS:
        raise DRelayError(f"unknown benchmark {name!r}; valid names: {', '.join(BENCHMARKS)}")
    root = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
    return root / _SPECS[name][0]


def load_benchmark(
    name: str,
    *,
    limit: int | None = None,
    seed: int = 0,
    data_dir: str | Path | None = None,
) -> list[BenchmarkPrompt]:
    """Load a benchmark's prompts, in file order.

    Args:
        name: one of `BENCHMARKS`.
        limit: if given, a seeded random subset of this many prompts (all of them if the set is
            smaller), still in file order. The subset for a smaller limit is contained in the
            one for a larger limit with the same seed, so quick runs are prefixes of long ones.
        seed: seed of the subset; the same (name, limit, seed, data) always gives the same prompts.
        data_dir: a directory with the `data/benchmarks` layout; default `default_data_dir()`.

    Returns:
        list of BenchmarkPrompt with unique `prompt_id`s.

    Raises:
        DRelayError: unknown name, limit <= 0, missing or empty file, malformed row, duplicate id.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0):
        raise DRelayError(f"limit must be a positive integer or None, got {limit!r}")
    path = benchmark_path(name, data_dir)
    prompts = _SPECS[name][1](list(read_rows(path)))
    if not prompts:
        raise DRelayError(f"no {name} prompts in {path}")
    seen: set[str] = set()
    for p in prompts:
        if p.prompt_id in seen:
            raise DRelayError(f"{path}: duplicate {name} prompt id {p.prompt_id!r}")
        seen.add(p.prompt_id)
    if limit is None or limit >= len(prompts):
        return prompts
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    return [prompts[i] for i in sorted(order[:limit])]


def parse_benchmarks(text: str, flag: str = "--benchmarks") -> tuple[str, ...]:
    """'all' or a comma list of benchmark names → names in the paper's order (unknown: DRelayError)."""
    if text.strip() == "all":
        return BENCHMARKS
    names = [t.strip() for t in text.split(",")]
    if not names or any(not n for n in names):
        raise DRelayError(f"{flag}: expected 'all' or a comma-separated list, got {text!r}")
    for n in names:
        if n not in BENCHMARKS:
            raise DRelayError(f"unknown benchmark '{n}' (choose from: all, {', '.join(BENCHMARKS)})")
    return tuple(b for b in BENCHMARKS if b in names)


def load_benchmarks(names: tuple[str, ...], *, limit: int | None, seed: int = 0, data_dir: str | Path | None = None):
    """{name: prompts} for several benchmarks, each as `load_benchmark` returns it."""
    return {b: load_benchmark(b, limit=limit, seed=seed, data_dir=data_dir) for b in names}


def first_turn_prompts(tokenizer, benchmark: str, n: int, *, seed: int = 0) -> list[list[int]]:
    """The first `n` prompts of a seeded subset of `benchmark`, each its first turn rendered as a chat
    prompt (token ids): the same ids for every engine compared on them."""
    from pipelines.common.chat import user_prompt

    return [user_prompt(tokenizer, p.turns[0]) for p in load_benchmark(benchmark, limit=n, seed=seed)]
