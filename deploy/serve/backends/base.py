"""The backend interface the Serve app talks to: token ids in, streamed token ids + spec statistics out.

A backend owns the model and its decoding; the app owns HTTP, prompt rendering, limits and metrics.
Chunks carry token ids; the app detokenises them (one tokenizer, whichever backend runs).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from drelay_model.decoding import GenerationConfig
from drelay_model.decoding.logprobs import TokenLogprob
from drelay_model.errors import DRelayError


# `sglext` keys of the engine's time-to-first-token parts (seconds; they sum to its TTFT)
TTFT_PARTS = ("queue_time_s", "prefill_time_s", "first_round_time_s")


class Overloaded(DRelayError):
    """The backend's queue is full; the app answers 503 with Retry-After."""


@dataclass(frozen=True)
class GenRequest:
    """A tokenized prompt and its validated decode settings (token budget, sampling, stop predicate);
    logprobs = k ≥ 0 asks for each token's log-probability and its k most likely alternatives."""

    prompt_ids: list[int]
    settings: GenerationConfig = GenerationConfig()
    logprobs: int | None = None


@dataclass(frozen=True)
class SpecStats:
    """SGLang's per-request speculative statistics (the `sglext` fields).

    verify_ct         verification rounds (target forwards after prefill).
    accept_histogram  [H+1] rounds that accepted exactly n drafts.
    completion_tokens generated tokens; accept_length = completion_tokens / verify_ct (SGLang's rule).
    drafted_ct        rounds that drafted (the rest were AR rounds of cost-aware verification; None:
                      the backend does not say); verified_drafts: drafts verified in them.
    ttft_parts        the engine's time to first token in seconds, split (`RequestStats`): queue wait
                      (submitted → its prefill starts), prefill, first round (prefill end → first
                      token out); None: the backend does not say.
    """

    verify_ct: int
    accept_histogram: list[int] = field(default_factory=list)
    completion_tokens: int = 0
    drafted_ct: int | None = None
    verified_drafts: int = 0
    ttft_parts: tuple[float, float, float] | None = None

    @property
    def verify_length(self) -> float:
        """Mean drafts verified per drafted round (0.0 when none drafted)."""
        return self.verified_drafts / self.drafted_ct if self.drafted_ct else 0.0

    @property
    def accept_length(self) -> float:
        return self.completion_tokens / self.verify_ct if self.verify_ct else 0.0

    def sglext(self, method: str) -> dict:
        """The response's `sglext` object: SGLang's field names (its `SpecTokensDetails`), plus
        `spec_drafted_ct` / `spec_verify_length` and the TTFT parts (`TTFT_PARTS`) when the backend
        reports them, and the method."""
        ext = {
            "spec_verify_ct": self.verify_ct,
            "spec_accept_length": self.accept_length,
            "spec_correct_drafts_histogram": self.accept_histogram,
        }
        if self.drafted_ct is not None:
            ext |= {"spec_drafted_ct": self.drafted_ct, "spec_verify_length": self.verify_length}
        if self.ttft_parts is not None:
            ext |= dict(zip(TTFT_PARTS, self.ttft_parts))
        return ext | {"method": method}


@dataclass(frozen=True)
class GenChunk:
    """Newly committed ids; the last chunk has finish_reason ('stop' | 'length') and the stats;
    logprobs: one entry per id when the request asked, else None."""

    token_ids: list[int]
    finish_reason: str | None = None
    spec: SpecStats | None = None
    logprobs: list[TokenLogprob] | None = None


class Backend:
    """What a backend implements; see EngineBackend and SGLangBackend."""

    method: str
    context_window: int
    tokenizer: object

    def generate(self, request: GenRequest) -> AsyncIterator[GenChunk]:  # pragma: no cover - interface
        raise NotImplementedError

    def load(self) -> dict[str, int]:
        """{'running': n, 'waiting': m} right now (admission control, metrics)."""
        return {"running": 0, "waiting": 0}

    def drain_batch_sizes(self) -> list[int]:
        """The rows of each decoding step's round since the last call (metrics); [] when the backend
        does not say."""
        return []

    def threads(self) -> dict:
        """What /health reports of the replica's CPU threads."""
        import torch

        return {"torch_threads": torch.get_num_threads()}

    def ready(self) -> bool:  # pragma: no cover - interface
        raise NotImplementedError

    def shutdown(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError
