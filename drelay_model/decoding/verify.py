"""Verification rules: how many drafted tokens the target accepts, and its own next token.

Both rules are lossless: every committed token is exactly what the target alone would produce
(greedy) or is a sample from the target's own conditional given the true prefix (T > 0).

Shapes: B rows, G = drafted path length (≤ H; 0 for autoregressive decoding), V vocabulary.
"""

from __future__ import annotations

import torch


Generators = torch.Generator | list[torch.Generator] | None


def pick_tokens(logits: torch.Tensor, temperature: float, generator: Generators) -> torch.Tensor:
    """The target's token at every position: argmax (T = 0) or a sample from softmax(logits / T).

    logits [B, ...,  V] float32 → [B, ...] int64. `generator` is one generator for the whole batch,
    or one per row (row b samples only from generator[b], so its draws do not depend on the other
    rows of the batch).
    """
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if isinstance(generator, list):
        assert len(generator) == probs.shape[0], "one generator per batch row"
        rows = [torch.multinomial(p.reshape(-1, p.shape[-1]), 1, generator=g) for p, g in zip(probs, generator)]
        return torch.stack(rows).view(probs.shape[:-1])
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def accepted_prefix(match: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of True along the last dim — how many drafts a round accepts:
    match [..., G] bool → [...] int64 = Σ_g Π_{j≤g} match[..., j]."""
    return match.long().cumprod(dim=-1).sum(dim=-1)


def accept(
    path: torch.Tensor,
    target_logits: torch.Tensor,
    length: torch.Tensor,
    *,
    temperature: float = 0.0,
    generator: Generators = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept the longest drafted prefix that matches the target, then take the target's token.

    Position j of the verify forward sees the anchor and path[:j]; its target token x_j is the
    greedy argmax (T = 0) or a fresh sample (T > 0). Draft j is accepted while path[j] == x_j for all
    earlier j: the accepted drafts are then exactly the target's own tokens, and x_n (n = accepted
    count) is the bonus/replacement token. Samples at positions past the first mismatch are
    discarded, so each committed token is one draw from the target's conditional on the true prefix.

    Args:
        path           [B, G] int64 drafted tokens.
        target_logits  [B, G+1, V] float32 target logits at the anchor and each drafted position.
        length         [B] int64 how many path tokens each row submitted (≤ G).
    Returns:
        accepted [B] int64 in [0, length], next_token [B] int64.
    """
    B, G = path.shape
    x = pick_tokens(target_logits, temperature, generator)  # [B, G+1]
    match = path == x[:, :G]  # [B, G]
    match &= torch.arange(G, device=path.device)[None, :] < length[:, None]
    accepted = accepted_prefix(match)  # [B] leading run of matches
    next_token = x.gather(1, accepted[:, None])[:, 0]
    return accepted, next_token
