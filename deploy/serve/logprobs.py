"""OpenAI's `logprobs` objects from the engine's per-token log-probabilities (`TokenLogprob`).

    chat         choice.logprobs = {"content": [{"token", "logprob", "bytes", "top_logprobs":
                 [{"token", "logprob", "bytes"}, …k]}, …], "refusal": null}
    completions  choice.logprobs = {"tokens": [str], "token_logprobs": [float],
                 "top_logprobs": [{token: logprob}] (the k most likely and the chosen token, as
                 OpenAI's "up to logprobs + 1" and vLLM), "text_offset": [int]}

Token strings are the tokenizer's tokens: for a byte-level BPE tokenizer (SmolLM2, Llama 3, Qwen)
`bytes` are the token's exact UTF-8 bytes and `token` their text (U+FFFD where a token holds part of a
multi-byte character, as vLLM); for others the decoded text and its UTF-8 bytes (a SentencePiece
byte-fallback token `<0xAB>` is its one byte). `text_offset` counts characters of the tokens' text
from the start of the completion (vLLM's rule), continuing across streamed chunks.
"""

from __future__ import annotations

import math
import re

from drelay_model.decoding.logprobs import TokenLogprob

MAX_CHAT_TOP_LOGPROBS = 20  # OpenAI's bound on chat `top_logprobs`
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound on completions `logprobs`
_FLOOR = -9999.0  # a −inf log-probability (a masked vocabulary entry) as a JSON number, as vLLM
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2): printable Latin-1 bytes stand for themselves, the other
    bytes b for chr(256 + n), n counting them in byte order. Returns char → byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF = _byte_level_alphabet()


def _is_byte_level(tokenizer) -> bool:
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return type(decoder).__name__ == "ByteLevel"


class TokenTexts:
    """token id → (text, UTF-8 bytes) for one tokenizer, cached."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.byte_level = _is_byte_level(tokenizer)
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._lookup(token_id)
        return hit

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return "", []
        if self.byte_level and all(c in _BYTE_OF for c in piece):
            raw = bytes(_BYTE_OF[c] for c in piece)
            return raw.decode("utf-8", errors="replace"), list(raw)
        fallback = _BYTE_FALLBACK.fullmatch(piece)
        if fallback:
            raw = bytes([int(fallback[1], 16)])
            return raw.decode("utf-8", errors="replace"), list(raw)
        text = self.tokenizer.decode([token_id])
        return text, list(text.encode("utf-8"))


def _number(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _FLOOR


class LogprobRenderer:
    """One request's `logprobs` objects: `render(entries)` for the tokens of one answer or chunk."""

    def __init__(self, texts: TokenTexts, route: str, k: int) -> None:
        self.texts, self.route, self.k = texts, route, k
        self.offset = 0  # completions: characters of the tokens rendered so far

    def render(self, entries: list[TokenLogprob]) -> dict:
        return self._chat(entries) if self.route == "chat" else self._completions(entries)

    def _chat(self, entries: list[TokenLogprob]) -> dict:
        def item(token_id: int, logprob: float) -> dict:
            text, raw = self.texts(token_id)
            return {"token": text, "logprob": _number(logprob), "bytes": raw}

        content = [{**item(e.token_id, e.logprob), "top_logprobs": [item(i, lp) for i, lp in e.top]} for e in entries]
        return {"content": content, "refusal": None}

    def _completions(self, entries: list[TokenLogprob]) -> dict:
        tokens, offsets, tops = [], [], []
        for e in entries:
            text = self.texts(e.token_id)[0]
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
            top: dict[str, float] = {}
            for i, lp in (*e.top, (e.token_id, e.logprob)):  # most likely first; the chosen token last
                top.setdefault(self.texts(i)[0], _number(lp))
            tops.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": [_number(e.logprob) for e in entries],
            "top_logprobs": tops,
            "text_offset": offsets,
        }
