"""The per-row sampling and acceptance rule of the continuous batcher (settings: `GenerationConfig`).

A request samples from the target's *filtered* conditional
    p̃(v) ∝ softmax(logits / T)(v) · [v in top-k] · [v in the smallest top-p nucleus]
(T = 0: argmax). Verification stays lossless with respect to p̃ by the argument of `verify.accept`:
the target's token x_j at every verified position is the draw from p̃ at that output position's
uniform (`draws.py`), and a draft is accepted only while it equals x_j; the numbers of positions
past the first mismatch are not consumed, so a seeded request commits what it would alone, undrafted.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from drelay_model.decoding.draws import RowDraws, inverse_cdf
from drelay_model.decoding.generation import GenerationConfig
from drelay_model.decoding.verify import accept_target_tokens


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


def pick_row(logits: torch.Tensor, settings: GenerationConfig, draws: RowDraws | None) -> torch.Tensor:
    """The target's token at each of T positions of one row: logits [T, V] → [T] int64 (T > 0: the
    inverse-CDF draw at each position's uniform, peeked from `draws`, not consumed)."""
    if settings.greedy:
        return logits.argmax(dim=-1)
    probs = torch.softmax(filtered_logits(logits.float(), settings), dim=-1)
    return inverse_cdf(probs, draws.token_uniforms(logits.shape[0]))


def accept_rows(
    path: torch.Tensor,
    target_logits: torch.Tensor,
    length: torch.Tensor,
    settings: Sequence[GenerationConfig],
    draws: Sequence[RowDraws | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify.accept` with each row's own settings (`verify.accept_target_tokens` on the tokens
    each row picks).

    Args:
        path [R, G] int64, target_logits [R, G+1, V] float32, length [R] int64; settings/draws: one
        per row (draws None for greedy rows).
    Returns:
        accepted [R] int64 in [0, length], next_token [R] int64.
    """
    x = target_logits.argmax(dim=-1)  # [R, G+1] greedy rows need nothing more
    for i, p in enumerate(settings):
        if not p.greedy:
            x[i] = pick_row(target_logits[i], p, draws[i])
    return accept_target_tokens(path, x, length, draws)
