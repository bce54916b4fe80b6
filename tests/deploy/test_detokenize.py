"""Incremental detokenisation with the real SmolLM2 tokenizer: streamed chunks add up to the full decode
(emoji and CJK split over tokens never show half a character), stop strings cut exactly even when
they span chunks, and the decoding work grows linearly with the text."""

from __future__ import annotations

import random

import pytest

from deploy.serve.backends.engine import load_tokenizer
from deploy.serve.detokenize import IncrementalText, stop_predicate

MIXED = "Hi 😀 猫が好きです。 Numbers: 3.14, ok?  émoji 🇫🇷 and 漢字 — done.\n\nNext line 👍🏽 end"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2-135m")


def _chunks(ids: list[int], sizes: list[int]) -> list[list[int]]:
    out, i = [], 0
    for n in sizes:
        out.append(ids[i : i + n])
        i += n
    return [c for c in out if c] + ([ids[i:]] if i < len(ids) else [])


def _stream(tok, ids: list[int], stops: list[str], sizes: list[int]) -> tuple[list[str], IncrementalText]:
    text = IncrementalText(tok, stops)
    chunks = _chunks(ids, sizes)
    deltas = [text.push(c, final=k == len(chunks) - 1) for k, c in enumerate(chunks)]
    return deltas, text


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streamed_text_equals_the_full_decode_and_never_splits_a_character(tok, seed):
    ids = tok(MIXED)["input_ids"]
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # the text really splits characters over tokens
    sizes = [random.Random(seed).choice([1, 1, 2, 3]) for _ in ids]
    deltas, text = _stream(tok, ids, [], sizes)
    assert "".join(deltas) == tok.decode(ids) == MIXED == text.full()
    assert not any("\ufffd" in d for d in deltas)


def test_a_stop_string_split_across_chunks_cuts_exactly(tok):
    ids = tok(MIXED)["input_ids"]
    stop = "好きです"  # CJK over several tokens, each pushed alone
    deltas, text = _stream(tok, ids, [stop], [1] * len(ids))
    assert "".join(deltas) == text.full() == MIXED[: MIXED.index(stop)]
    # and a stop string made of a newline pair, then an emoji split over byte tokens
    for stop in ("\n\nNext", "👍🏽"):
        deltas, _ = _stream(tok, ids, [stop], [1] * len(ids))
        assert "".join(deltas) == MIXED[: MIXED.index(stop)]


def test_the_earliest_stop_string_wins_and_nothing_past_it_is_ever_sent(tok):
    ids = tok(MIXED)["input_ids"]
    stops = ["done", "ok?", "Numbers: 3"]
    deltas, _ = _stream(tok, ids, stops, [2] * len(ids))
    assert "".join(deltas) == MIXED[: MIXED.index("Numbers: 3")]
    sent = ""
    for d in deltas:  # no prefix sent before the stop was complete reaches into it
        sent += d
        assert MIXED.index("Numbers: 3") >= len(sent)


def test_a_possible_stop_prefix_is_held_then_released(tok):
    text = IncrementalText(tok, ["STOP"])
    assert text.push(tok("Hello ST")["input_ids"], final=False) == "Hello "  # "ST" may begin "STOP"
    assert text.push(tok(" again")["input_ids"], final=False) == "ST again"


def test_an_unfinished_character_waits_and_the_last_chunk_flushes_it(tok):
    ids = tok("a😀")["input_ids"]
    assert tok.decode(ids[:-1]).endswith("\ufffd")  # the emoji's bytes span the last tokens
    text = IncrementalText(tok, [])
    assert text.push(ids[:1], final=False) == "a"
    assert text.push(ids[1:-1], final=False) == ""  # half an emoji: nothing yet
    assert text.push([], final=True) == tok.decode(ids[:-1])[1:]  # cut there, the rest as a full decode gives it


def test_decoding_work_is_linear_in_the_text(tok):
    """Pushed one token at a time, the tokens decoded in all stay a small multiple of the text's."""
    ids = tok(MIXED * 12)["input_ids"]

    class Counting:
        decoded = 0

        def decode(self, chunk, **kw):
            Counting.decoded += len(chunk)
            return tok.decode(chunk, **kw)

    text = IncrementalText(Counting(), ["never there"])
    out = "".join(text.push([i], final=False) for i in ids) + text.push([], final=True)
    assert out == MIXED * 12
    assert Counting.decoded < 8 * len(ids)  # re-decoding everything each time: len(ids)² / 2 ≈ 150 × this


def test_stop_predicate_sees_a_stop_in_the_tail(tok):
    ids = tok("one two three STOP four")["input_ids"]
    stop = stop_predicate(tok, ["STOP"])
    assert stop(ids) and not stop(tok("one two three")["input_ids"])
    assert stop_predicate(tok, []) is None
