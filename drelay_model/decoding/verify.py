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


def _row_draws(generator: Generators, B: int) -> list[torch.Generator | None]:
    return generator if isinstance(generator, list) else [generator] * B


def accept_sampled(
    path: torch.Tensor,
    target_logits: torch.Tensor,
    length: torch.Tensor,
    proposal_ids: torch.Tensor,
    proposal_q: torch.Tensor,
    *,
    temperature: float,
    generator: Generators = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling (Leviathan et al., 2023; Chen et al., 2023) for a path whose token j
    was drawn from a proposal q_j over the pool; p_j = softmax(logits_j / T) is the target's.

        accept d_j with probability min(1, p_j(d_j) / q_j(d_j)), in order, while all earlier were;
        at the first rejection n: x_n ~ norm(max(0, p_n − q_n));  all L accepted: x_L ~ p_L.

    Each committed token is then a draw from the target's p given the true prefix (lossless), and
    slot j is accepted with probability Σ_v min(p_j(v), q_j(v)) — against p_j(d_j) for a
    deterministic path under `accept`. A parallel drafter's q_j does not depend on d_{<j}; the rule
    needs only that d_j was drawn from the q_j it is given.

    Args:
        path           [B, G] int64 drafted tokens, path[b, j] ∈ proposal_ids[b, j].
        target_logits  [B, G+1, V] float32.
        length         [B] int64 path tokens each row submitted (≤ G).
        proposal_ids   [B, G, K] int64 the pool; proposal_q [B, G, K] its probabilities (rows sum
                       to 1; zero off the pool).
        generator      one generator, or one per row (row b draws only from generator[b]: first G
                       uniforms, then one token).
    Returns:
        accepted [B] int64 in [0, length], next_token [B] int64.
    """
    B, G = path.shape
    V = target_logits.shape[-1]
    p = torch.softmax(target_logits.float() / temperature, dim=-1)  # [B, G+1, V]
    q = torch.zeros(B, G, V, dtype=p.dtype, device=p.device).scatter_add_(2, proposal_ids[:, :G], proposal_q[:, :G].to(p.dtype))
    p_d = p[:, :G].gather(2, path[:, :, None])[:, :, 0]  # [B, G]
    q_d = q.gather(2, path[:, :, None])[:, :, 0].clamp(min=torch.finfo(p.dtype).tiny)
    gens = _row_draws(generator, B)
    u = torch.stack([torch.rand(G, generator=g, device=p.device) for g in gens]) if G else p_d.new_zeros(B, 0)
    ok = (u < p_d / q_d) & (torch.arange(G, device=path.device)[None, :] < length[:, None])
    accepted = accepted_prefix(ok)  # [B]
    rows = torch.arange(B, device=path.device)
    at = p[rows, accepted]  # [B, V] the target's distribution where the row stops
    q_at = torch.cat([q, q.new_zeros(B, 1, V)], dim=1)[rows, accepted]  # zero past the path: the bonus draws from p
    rejected = (accepted < length)[:, None]
    residual = torch.where(rejected, (at - q_at).clamp(min=0.0), at)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, at)  # p = q exactly: never rejected
    next_token = torch.stack([torch.multinomial(r, 1, generator=g)[0] for r, g in zip(residual, gens)])
    return accepted, next_token
