"""Regenerate training responses with the target's own greedy decoding (`drelay data regenerate`).

A drafter learns to predict what the *target* writes, not what a dataset's reference answer says (a
calibration run on reference answers lost a third of slot-1 accuracy to the style mismatch). So every
assistant turn of the training corpus is replaced, once, by the target's greedy continuation given the
conversation so far (with earlier turns already regenerated), and the exact token ids are kept: they
are the labels for drafter training.

Output: one JSON object per line, appended batch by batch to the plain `X.jsonl` and flushed, so an
interrupted run resumes where it stopped (a torn last line is dropped on restart); a finished run
moves the records into `X.jsonl.xz` (atomically, behind those it already holds: stored_jsonl.py), and
a later run resumes against both forms:
    {"conv_id", "source", "messages": [{"role", "content"}, ...], "turn_token_ids": [[...], ...],
     "finished": bool}          # finished = every turn ended with EOS (not cut by the token budget)
A conversation whose prompt outgrows `max_prompt_tokens` is recorded as {"conv_id", "source",
"skipped": reason}, so a resumed run does not retry it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from drelay_model.decoding import GenerationConfig, SpeculativeEngine
from drelay_model.errors import DRelayError
from pipelines.common.chat import render_chat
from pipelines.common.paths import REPO_ROOT
from pipelines.data.corpora import Conversation
from pipelines.data.stored_jsonl import (
    COMPRESSED_SUFFIXES,
    DECOMPRESSION_ERRORS,
    compress_into_xz,
    matching_files,
    open_text,
    plain_path,
)


# prompts (token ids) → the target's greedy answers (token ids, EOS included when an answer ended)
Generate = Callable[[list[list[int]]], list[list[int]]]


@dataclass(frozen=True)
class RegenerationSummary:
    done_before: int
    generated: int
    skipped_too_long: int
    tokens: int
    seconds: float
    path: Path  # where the records are now (X.jsonl.xz once compressed, else X.jsonl)


def record_key(record: dict) -> str:
    """A conversation's identity across sources: ids repeat between corpora (gsm8k "14", alpaca "14")."""
    return f"{record.get('source', '')}/{record['conv_id']}"


def read_done(path: Path) -> set[str]:
    """Keys (`record_key`) of conversations already regenerated in the data file `path` (its plain
    and compressed forms); truncates a torn last line of the plain file in place."""
    path = plain_path(path)
    done = set()
    for compressed in (path.with_name(path.name + s) for s in COMPRESSED_SUFFIXES):
        if compressed.is_file():
            done |= read_done_ids(compressed)
    if not path.exists():
        return done
    good_bytes = 0
    with path.open("rb") as f:
        for line in f:
            try:
                done.add(record_key(json.loads(line)))
            except (json.JSONDecodeError, KeyError, UnicodeDecodeError):
                break  # a torn write from an interrupted run: everything after it is dropped
            good_bytes += len(line)
    if good_bytes < path.stat().st_size:
        with path.open("r+b") as f:
            f.truncate(good_bytes)
    return done


def read_done_ids(path: Path) -> set[str]:
    """Keys (`record_key`) in one stored file, plain or compressed (read-only: a torn last line is
    ignored, not cut)."""
    ids = set()
    try:
        with open_text(path) as f:
            for line in f:
                try:
                    ids.add(record_key(json.loads(line)))
                except (json.JSONDecodeError, KeyError):
                    break
    except DECOMPRESSION_ERRORS as exc:
        raise DRelayError(f"{path}: not a readable compressed file ({exc or type(exc).__name__})") from exc
    return ids


def output_plan(target_spec: str, out: str | None, shard: tuple[int, int] | None) -> tuple[Path, set[str]]:
    """Where a run writes (default data/regenerated/<target>[.shard-K-of-N].jsonl; a compressed
    name means its plain file) and which conversations sibling files of the same target already
    hold, in any stored form (skipped when sharding)."""
    base = REPO_ROOT / "data" / "regenerated" / target_spec
    if shard is None:
        return (plain_path(out) if out else base.with_suffix(".jsonl")), set()
    k, n = shard
    path = plain_path(out) if out else base.parent / f"{target_spec}.shard-{k}-of-{n}.jsonl"
    done_elsewhere: set[str] = set()
    for sibling in matching_files(base.parent / f"{target_spec}*.jsonl"):
        if plain_path(sibling).resolve() != path.resolve():
            done_elsewhere |= read_done_ids(sibling)
    return path, done_elsewhere


def _regenerate_batch(generate: Generate, eos_ids, tokenizer, convs: list[Conversation], max_prompt: int):
    """Regenerate every assistant turn of a batch of conversations, turn index by turn index."""
    histories = [[m for m in c.messages if m["role"] == "system"] for c in convs]
    users = [[m["content"] for m in c.messages if m["role"] == "user"] for c in convs]
    turn_ids: list[list[list[int]]] = [[] for _ in convs]
    finished = [True] * len(convs)
    too_long: set[int] = set()
    eos = set(eos_ids)
    for t in range(max(len(u) for u in users)):
        rows = [i for i in range(len(convs)) if t < len(users[i]) and i not in too_long]
        prompts = []
        for i in list(rows):
            histories[i].append({"role": "user", "content": users[i][t]})
            ids = render_chat(tokenizer, histories[i])
            if len(ids) > max_prompt:
                too_long.add(i)
                rows.remove(i)
            else:
                prompts.append(ids)
        if not rows:
            continue
        for i, toks in zip(rows, generate(prompts)):
            ended = bool(toks) and toks[-1] in eos
            finished[i] &= ended
            text = tokenizer.decode(toks[:-1] if ended else toks, skip_special_tokens=True)
            histories[i].append({"role": "assistant", "content": text})
            turn_ids[i].append(toks)
    records = [
        {"conv_id": c.conv_id, "source": c.source, "skipped": "prompt too long"}
        if i in too_long
        else {
            "conv_id": c.conv_id,
            "source": c.source,
            "messages": histories[i],
            "turn_token_ids": turn_ids[i],
            "finished": finished[i],
        }
        for i, c in enumerate(convs)
    ]
    return records, len(too_long), sum(len(t) for ids in turn_ids for t in ids)


def _schedule(convs: list[Conversation], window: int) -> list[Conversation]:
    """Order the work so that any finished prefix is a useful sample of every source: sources
    round-robin, then similar prompt lengths together inside each window (less padding per batch)."""
    by_source: dict[str, list[Conversation]] = {}
    for c in convs:
        by_source.setdefault(c.source, []).append(c)
    queues = list(by_source.values())
    mixed = [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]
    prompt_len = lambda c: sum(len(m["content"]) for m in c.messages if m["role"] == "user")  # noqa: E731
    return [c for i in range(0, len(mixed), window) for c in sorted(mixed[i : i + window], key=prompt_len)]


def regenerate(
    target,
    conversations: list[Conversation],
    out_path: str | Path,
    *,
    batch_size: int = 16,
    decode: GenerationConfig = GenerationConfig(),
    max_prompt_tokens: int = 1024,
    progress: bool = True,
    done_elsewhere: set[str] = frozenset(),
    compress: bool = True,
    generate: Generate | None = None,
) -> RegenerationSummary:
    """Greedy-regenerate the assistant turns of `conversations` into the data file `out_path`
    (resumable; a compressed name means its plain file).

    `done_elsewhere`: conversation ids already regenerated in sibling files (parallel shards).
    `compress`: once every conversation is done, move the records into `<out_path>.xz`.
    `generate`: another engine's greedy decoding under `decode`'s budget (deploy/vllm/regenerate.py: vLLM
    through Ray Data LLM), one call per turn index of a batch; default our engine, AR."""
    import time

    if target.tokenizer is None:
        raise DRelayError(f"target '{target.name}' has no tokenizer; regeneration needs a chat template")
    if batch_size < 1:
        raise DRelayError(f"batch_size must be ≥ 1, got {batch_size}")
    if not decode.greedy:
        raise DRelayError("regeneration keeps the target's greedy answers; temperature must be 0")
    out_path = plain_path(out_path)
    try:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        done = read_done(out_path)
        out_path.touch()
    except OSError as exc:
        raise DRelayError(f"cannot write regenerated data to '{out_path}': {exc.strerror}") from exc
    finished = done | done_elsewhere
    todo = _schedule([c for c in conversations if f"{c.source}/{c.conv_id}" not in finished], window=16 * batch_size)
    if generate is None:
        engine = SpeculativeEngine(target)
        generate = lambda prompts: engine.generate(prompts, decode).tokens  # noqa: E731
    skipped = tokens = 0
    start = time.perf_counter()
    bar = tqdm(total=len(todo), desc="regenerate", unit="conv", disable=not progress)
    with out_path.open("a", encoding="utf-8") as out:
        for i in range(0, len(todo), batch_size):
            batch = todo[i : i + batch_size]
            records, n_long, n_tok = _regenerate_batch(generate, target.eos_token_ids, target.tokenizer, batch, max_prompt_tokens)
            out.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
            out.flush()
            skipped, tokens = skipped + n_long, tokens + n_tok
            bar.update(len(todo[i : i + batch_size]))
            bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - start):.0f}")
    bar.close()
    stored = compress_into_xz(out_path, record_key) if compress else out_path
    return RegenerationSummary(len(done), len(todo) - skipped, skipped, tokens, time.perf_counter() - start, stored)
