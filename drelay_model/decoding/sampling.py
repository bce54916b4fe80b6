"""The per-row sampling and acceptance rule of the continuous batcher (settings: `GenerationConfig`).

A request samples from the target's *filtered* conditional
    p̃(v) ∝ softmax(logits / T)(v) · [v in top-k] · [v in the smallest top-p nucleus]
(T = 0: argmax). Verification stays lossless with respect to p̃ by the argument of `verify.accept`:
the target's token x_j at every verified position is one draw from p̃ given the true prefix, and a
draft is accepted only while it equals x_j; draws past the first mismatch are discarded.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from drelay_model.decoding.generation import GenerationConfig


def filtered_logits(logits: torch.Tensor, settings: GenerationConfig) -> torch.Tensor:
    """logits [..., V] → logits / T with entries outside top-k / the top-p nucleus set to −inf."""
    x = logits / settings.temperature
    V = x.shape[-1]
    if 0 < settings.top_k < V:
        kth = x.topk(settings.top_k, dim=-1).values[..., -1:]  # [..., 1]
        x = x.masked_fill(x < kth, float("-inf"))
    if settings.top_p < 1.0:
        sorted_x, order = x.sort(dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # Keep a token while the mass strictly before it is < top_p (the first token always stays).
        before = probs.cumsum(dim=-1) - probs
        drop_sorted = before >= settings.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def pick_row(logits: torch.Tensor, settings: GenerationConfig, generator: torch.Generator | None) -> torch.Tensor:
    """The target's token at each of T positions of one row: logits [T, V] → [T] int64."""
    if settings.greedy:
        return logits.argmax(dim=-1)
    probs = torch.softmax(filtered_logits(logits, settings), dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def accept_rows(
    path: torch.Tensor,
    target_logits: torch.Tensor,
    length: torch.Tensor,
    settings: Sequence[GenerationConfig],
    generators: Sequence[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify.accept` with each row's own settings.

    Args:
        path [R, G] int64, target_logits [R, G+1, V] float32, length [R] int64; settings/generators: one per row.
    Returns:
        accepted [R] int64 in [0, length], next_token [R] int64.
    """
    R, G = path.shape
    x = target_logits.argmax(dim=-1)  # [R, G+1] greedy rows need nothing more
    for i, p in enumerate(settings):
        if not p.greedy:
            x[i] = pick_row(target_logits[i], p, generators[i])
    match = path == x[:, :G]  # [R, G]
    match &= torch.arange(G, device=path.device)[None, :] < length[:, None]
    accepted = match.long().cumprod(dim=1).sum(dim=1)  # [R] leading run of matches
    return accepted, x.gather(1, accepted[:, None])[:, 0]
