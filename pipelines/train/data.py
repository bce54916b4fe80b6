"""Training sequences: token ids + a response mask, from regenerated conversations or token files.

Formats (by file content):
  regenerated  lines from `drelay data regenerate`: one sequence per assistant turn, = the chat
               template of the conversation up to that user turn (with generation prompt) followed
               by the exact token ids the target generated. The mask covers those generated ids.
  tokenized    lines {"seq_id", "input_ids": [...], "response_start": int} (tests, custom data).
  reference    (data.fallback_reference_answers) the corpora's own answers, rendered with the chat
               template; labels then come from the target's teacher-forced argmax (weaker).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from drelay_model.errors import DRelayError
from pipelines.common.chat import render_chat
from pipelines.data.stored_jsonl import matching_files, read_text, stored_forms


@dataclass(frozen=True)
class TrainSequence:
    seq_id: str
    input_ids: tuple[int, ...]
    response_start: int  # positions ≥ response_start are the target's response


def _from_regenerated(record: dict, tokenizer) -> list[TrainSequence]:
    out, history = [], []
    turns = iter(record["turn_token_ids"])
    for message in record["messages"]:
        if message["role"] == "assistant":
            ids = next(turns)
            prompt = render_chat(tokenizer, history)
            key = f"{record.get('source', '')}/{record['conv_id']}"  # ids repeat across sources
            out.append(TrainSequence(f"{key}#{len(out)}", tuple(prompt + ids), len(prompt)))
        history.append(message)
    return out


def data_files(pattern: str | Path) -> list[Path]:
    """One data file, or every file matching a glob (e.g. the shards of a parallel regeneration);
    each in whichever stored forms exist (`X.jsonl`, `X.jsonl.xz`, `X.jsonl.gz`:
    pipelines/data/stored_jsonl.py)."""
    text = str(pattern)
    if any(ch in text for ch in "*?["):
        files = matching_files(text)
        if not files:
            raise DRelayError(f"no training data file matches '{text}' (run `drelay data regenerate` first)")
        return files
    files = stored_forms(text)
    if not files:
        raise DRelayError(f"training data file '{text}' not found (run `drelay data regenerate` first)")
    return files


def read_sequences(path: str | Path, tokenizer=None, *, max_seq_len: int) -> list[TrainSequence]:
    """All sequences of regenerated or tokenized JSONL file(s) (a path or a glob), cut to
    max_seq_len tokens; a conversation present in several files counts once."""
    seqs: list[TrainSequence] = []
    seen: set[str] = set()
    for file in data_files(path):
        for seq in _read_file(file, tokenizer):
            if seq.seq_id not in seen:
                seen.add(seq.seq_id)
                seqs.append(seq)
    seqs = [TrainSequence(s.seq_id, s.input_ids[:max_seq_len], s.response_start) for s in seqs]
    seqs = [s for s in seqs if len(s.input_ids) - s.response_start >= 2]  # room for one anchor
    if not seqs:
        raise DRelayError(f"training data '{path}' holds no usable sequences")
    return seqs


def _read_file(path: Path, tokenizer) -> list[TrainSequence]:
    seqs: list[TrainSequence] = []
    text = read_text(path)
    # JSONL lines end at "\n" only: str.splitlines() would also split inside strings that hold
    # U+2028/U+2029 or \x85 (legal in JSON, and the regenerated data writes non-ASCII as is).
    lines = text.split("\n")
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            if n == len(lines) and not text.endswith("\n"):
                break  # a torn last line: a regeneration still writing (or killed mid-write)
            raise DRelayError(f"{path}:{n}: not valid JSON ({exc.msg})") from exc
        if rec.get("skipped"):
            continue
        if "input_ids" in rec:
            seqs.append(TrainSequence(str(rec.get("seq_id", n)), tuple(rec["input_ids"]), int(rec["response_start"])))
        elif "turn_token_ids" in rec:
            if tokenizer is None:
                raise DRelayError(f"{path}: regenerated conversations need a target with a tokenizer")
            seqs.extend(_from_regenerated(rec, tokenizer))
        else:
            raise DRelayError(f"{path}:{n}: expected 'input_ids' or 'turn_token_ids'")
    return seqs


def reference_sequences(conversations, tokenizer, *, max_seq_len: int) -> list[TrainSequence]:
    """Fallback: the corpora's reference answers (first assistant turn), template-rendered."""
    seqs = []
    for c in conversations:
        msgs = list(c.messages)
        first = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), None)
        if first is None:
            continue
        prompt = render_chat(tokenizer, msgs[:first])
        full = render_chat(tokenizer, msgs[: first + 1], generation_prompt=False)
        if len(full) - len(prompt) >= 2:
            seqs.append(TrainSequence(f"{c.source}/{c.conv_id}", tuple(full[:max_seq_len]), len(prompt)))
    return seqs


def split_validation(seqs: list[TrainSequence], fraction: float) -> tuple[list[TrainSequence], list[TrainSequence]]:
    """Deterministic split by a hash of the conversation id (all turns of a conversation together)."""

    def bucket(s: TrainSequence) -> float:
        digest = hashlib.sha1(s.seq_id.split("#")[0].encode()).digest()
        return int.from_bytes(digest[:4], "big") / 2**32

    train = [s for s in seqs if bucket(s) >= fraction]
    val = [s for s in seqs if bucket(s) < fraction]
    return train, val


def batch_order(n_seqs: int, lengths: list[int], batch: int, seed: int, epoch: int) -> list[list[int]]:
    """Length-bucketed batches in a seeded, per-epoch random order (same on every worker)."""
    rng = random.Random(seed * 1_000_003 + epoch)
    idx = list(range(n_seqs))
    rng.shuffle(idx)
    chunk = batch * 32  # sort within chunks: similar lengths per batch, still random overall
    idx = [i for c in range(0, n_seqs, chunk) for i in sorted(idx[c : c + chunk], key=lambda i: lengths[i])]
    batches = [idx[i : i + batch] for i in range(0, n_seqs, batch)]
    rng.shuffle(batches)
    return batches


def collate(seqs: list[TrainSequence], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """→ input_ids [B, N] int64 (right-padded), loss_mask [B, N] bool (response positions)."""
    N = max(len(s.input_ids) for s in seqs)
    ids = torch.full((len(seqs), N), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), N, dtype=torch.bool)
    for b, s in enumerate(seqs):
        ids[b, : len(s.input_ids)] = torch.tensor(s.input_ids)
        mask[b, s.response_start : len(s.input_ids)] = True
    return ids, mask


def label_counts(seqs: list[TrainSequence], vocab_size: int) -> torch.Tensor:
    """[V] how often each token is a response label (for the draft vocabulary)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in seqs:
        counts += torch.bincount(torch.tensor(s.input_ids[s.response_start :]), minlength=vocab_size)
    return counts
