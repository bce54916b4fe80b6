"""Per-request sampling settings and the per-row acceptance rule of the continuous batcher.

A request samples from the target's *filtered* conditional
    p̃(v) ∝ softmax(logits / T)(v) · [v in top-k] · [v in the smallest top-p nucleus]
(T = 0: argmax). Verification stays lossless with respect to p̃ by the argument of `verify.accept`:
the target's token x_j at every verified position is one draw from p̃ given the true prefix, and a
draft is accepted only while it equals x_j; draws past the first mismatch are discarded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from drelay_model.errors import DRelayError

StopPredicate = Callable[[list[int]], bool]


@dataclass(frozen=True)
class SamplingParams:
    """One request's decode settings.

    max_new_tokens  generated-token budget (≥ 1).
    temperature     0 = greedy; otherwise in (0, 100].
    top_p           nucleus mass in (0, 1] (1 = off); top_k ≥ 0 (0 = off).
    seed            seeds this request's own generator (T > 0).
    stop_on_eos     stop after the target's EOS token.
    stop            optional predicate on the generated ids so far: True ends the request after the
                    token that made it true (how a caller implements stop strings: it detokenises;
                    the engine knows nothing about text).
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_on_eos: bool = True
    stop: StopPredicate | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise DRelayError(f"max_new_tokens must be ≥ 1, got {self.max_new_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise DRelayError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise DRelayError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise DRelayError(f"top_k must be ≥ 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] → logits / T with entries outside top-k / the top-p nucleus set to −inf."""
    x = logits / params.temperature
    V = x.shape[-1]
    if 0 < params.top_k < V:
        kth = x.topk(params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = x.sort(dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # Keep a token while the mass strictly before it is < top_p (the first token always stays).
        before = probs.cumsum(dim=-1) - probs
        drop_sorted = before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def pick_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """The target's token at each of T positions of one row: logits [T, V] → [T] int64."""
    if params.greedy:
        return logits.argmax(dim=-1)
    probs = torch.softmax(filtered_logits(logits, params), dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def accept_rows(
    path: torch.Tensor,
    target_logits: torch.Tensor,
    length: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify.accept` with each row's own settings.

    Args:
        path [R, G] int64, target_logits [R, G+1, V] float32, length [R] int64; params/generators: one per row.
    Returns:
        accepted [R] int64 in [0, length], next_token [R] int64.
    """
    R, G = path.shape
    x = target_logits.argmax(dim=-1)  # [R, G+1] greedy rows need nothing more
    for i, p in enumerate(params):
        if not p.greedy:
            x[i] = pick_row(target_logits[i], p, generators[i])
    match = path == x[:, :G]  # [R, G]
    match &= torch.arange(G, device=path.device)[None, :] < length[:, None]
    accepted = match.long().cumprod(dim=1).sum(dim=1)  # [R] leading run of matches
    return accepted, x.gather(1, accepted[:, None])[:, 0]
