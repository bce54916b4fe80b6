"""Token ids → the text a client may see, chunk by chunk, with stop strings.

`IncrementalText` decodes only a short window per chunk, so a request's text costs O(n) decoding in
all, not O(n²) (re-decoding everything on every chunk). The window runs over token offsets:

    ids[prefix:read]   tokens already turned into text (kept as context: a tokenizer may render a
                       token differently at the start of a string, e.g. SentencePiece's leading space)
    ids[read:]         tokens not yet turned into text

Each chunk decodes ids[prefix:read] and ids[prefix:]; the second's extra characters are the new text.
They are taken only when the decoded window does not end in U+FFFD: byte-level tokenizers split
multi-byte characters (emoji, CJK) over tokens, and half a character decodes to U+FFFD. Until the
character completes, the window grows; then `prefix, read ← read, len(ids)`. The last chunk flushes
whatever remains, as a full decode would.

Stop strings: the text ends before the earliest occurrence of any of them (searched only where a new
one can start), and the text sent so far never reaches past a suffix that could still begin one.
"""

from __future__ import annotations

from collections.abc import Callable

_REPLACEMENT = "\ufffd"  # what a tokenizer decodes an incomplete UTF-8 sequence to


class IncrementalText:
    """One request's text: `push` each chunk's token ids, get back the text safe to send now."""

    def __init__(self, tokenizer, stops: list[str]) -> None:
        self.tokenizer, self.stops = tokenizer, [s for s in stops if s]
        self.ids: list[int] = []
        self.prefix = self.read = 0  # token offsets (module docstring)
        self.text = ""  # decoded so far, cut at the first stop string
        self.stopped = False  # a stop string has been found: later tokens add nothing
        self.sent = 0  # characters of `text` already returned by `push`

    def full(self) -> str:
        """The text so far (after the last chunk: the whole answer)."""
        return self.text

    def push(self, ids: list[int], final: bool) -> str:
        """Add a chunk's token ids; return the text not sent before that is safe to send now."""
        if not self.stopped:
            self.ids += ids
            self._decode_window(final)
        end = len(self.text) if final or self.stopped else len(self.text) - self._stop_prefix_held()
        delta = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _decode_window(self, final: bool) -> None:
        known = self._decode(self.ids[self.prefix : self.read])
        window = self._decode(self.ids[self.prefix :])
        if len(window) <= len(known) or (window.endswith(_REPLACEMENT) and not final):
            return  # nothing visible yet (special tokens), or a character still incomplete
        before = len(self.text)
        self.text += window[len(known) :]
        self.prefix, self.read = self.read, len(self.ids)
        self._cut_at_stop(before)

    def _cut_at_stop(self, before: int) -> None:
        """Cut `text` at the earliest stop string that ends past `before` (earlier ones were found then)."""
        hits = []
        for s in self.stops:
            i = self.text.find(s, max(before - len(s) + 1, 0))
            if i >= 0:
                hits.append(i)
        if hits:
            self.text, self.stopped = self.text[: min(hits)], True

    def _stop_prefix_held(self) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string: a stop
        string completed by later tokens can start there, so that suffix is not sent yet."""
        held = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), held, -1):
                if self.text.endswith(s[:k]):
                    held = k
                    break
        return held


def stop_predicate(tokenizer, stops: list[str]) -> Callable[[list[int]], bool] | None:
    """True once the generated ids' tail contains a stop string (runs on the engine thread; decodes a
    bounded tail, so O(1) per call)."""
    if not stops:
        return None
    tail = 2 * max(len(s) for s in stops) + 4  # tokens: enough to hold any stop string

    def stop(ids: list[int]) -> bool:
        text = tokenizer.decode(ids[-tail:], skip_special_tokens=True)
        return any(s in text for s in stops)

    return stop
