"""Conversation → prompt token ids: the only place evaluation touches text.

The evaluation core works on token ids. An encoder turns the user turns so far plus the model's own
earlier answers (token ids) into the ids of the next prompt:

    encode(turns=[u1], answers=[])        → prompt for turn 1
    encode(turns=[u1, u2], answers=[a1])  → prompt for turn 2, conditioned on the model's answer a1

`ChatTemplateEncoder` applies the target's chat template (the real thing); `HashEncoder` is a
deterministic stand-in for tokenizer-less test targets (`tiny-llama`): one id per word.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Protocol

from pipelines.common.chat import render_chat


class PromptEncoder(Protocol):
    def encode(self, turns: Sequence[str], answers: Sequence[Sequence[int]]) -> list[int]:
        """Prompt ids for turn len(turns); `answers` holds the model's len(turns) - 1 earlier answers."""
        ...


class ChatTemplateEncoder:
    """User/assistant messages through the tokenizer's chat template, with the generation prompt.

    Earlier answers are decoded to text (special tokens dropped) and re-encoded by the template, as a
    chat client would send them back.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def encode(self, turns: Sequence[str], answers: Sequence[Sequence[int]]) -> list[int]:
        assert len(answers) == len(turns) - 1, (len(turns), len(answers))
        messages = []
        for i, turn in enumerate(turns):
            messages.append({"role": "user", "content": turn})
            if i < len(answers):
                text = self.tokenizer.decode(list(answers[i]), skip_special_tokens=True)
                messages.append({"role": "assistant", "content": text})
        return render_chat(self.tokenizer, messages)


class HashEncoder:
    """Tokenizer-free stand-in: each whitespace word → crc32 mod vocab; answers appended as ids.

    `max_words` keeps long benchmark prompts inside a tiny target's context window (tests only).
    """

    def __init__(self, vocab_size: int, *, max_words: int = 64) -> None:
        self.vocab_size = vocab_size
        self.max_words = max_words

    def _words(self, text: str) -> list[int]:
        return [zlib.crc32(w.encode()) % self.vocab_size for w in text.split()[: self.max_words]] or [0]

    def encode(self, turns: Sequence[str], answers: Sequence[Sequence[int]]) -> list[int]:
        assert len(answers) == len(turns) - 1, (len(turns), len(answers))
        ids: list[int] = []
        for i, turn in enumerate(turns):
            ids += self._words(turn)
            if i < len(answers):
                ids += list(answers[i])
        return ids


def encoder_for(target) -> PromptEncoder:
    """The chat template when the target has a tokenizer, else the hash stand-in."""
    if target.tokenizer is not None:
        return ChatTemplateEncoder(target.tokenizer)
    return HashEncoder(target.vocab_size)
