"""Verification rules: how many drafted tokens the target accepts, and its own next token.

Both rules are lossless: every committed token is exactly what the target alone would produce
(greedy) or is a sample from the target's own conditional given the true prefix (T > 0).

Shapes: B rows, G = drafted path length (≤ H; 0 for autoregressive decoding), V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from drelay_model.decoding.draws import RowDraws, commit_rows, inverse_cdf

Draws = Sequence[RowDraws] | None  # one per row at T > 0 (None: fresh unseeded numbers for this call)


def _row_draws(draws: Draws, B: int, device: torch.device) -> Sequence[RowDraws]:
    if draws is None:
        return [RowDraws(int(torch.randint(0, 2**62, ())), device) for _ in range(B)]
    assert len(draws) == B, "one RowDraws per batch row"
    return draws


def pick_tokens(logits: torch.Tensor, temperature: float, draws: Draws) -> torch.Tensor:
    """The target's token at every position: argmax (T = 0) or the inverse-CDF draw of
    softmax(logits / T) at each position's uniform (`draws.py`; peeked, not consumed).

    logits [B, V] or [B, T, V] float32 → [B] or [B, T] int64; row b reads only draws[b].
    """
    if temperature <= 0:
        return logits.argmax(dim=-1)
    rows = _row_draws(draws, logits.shape[0], logits.device)
    flat = logits.reshape(logits.shape[0], -1, logits.shape[-1])  # [B, T, V]
    probs = torch.softmax(flat.float() / temperature, dim=-1)
    picked = [inverse_cdf(p, d.token_uniforms(p.shape[0])) for p, d in zip(probs, rows)]
    return torch.stack(picked).view(logits.shape[:-1])


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
    draws: Draws = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept the longest drafted prefix that matches the target, then take the target's token.

    Position j of the verify forward sees the anchor and path[:j]; its target token x_j is the
    greedy argmax (T = 0) or the draw at that output position's uniform (T > 0, `draws.py`). Draft j
    is accepted while path[j] == x_j for all earlier j: the accepted drafts are then exactly the
    target's own tokens, and x_n (n = accepted count) is the bonus/replacement token. Draws past the
    first mismatch are not consumed, so each committed token is the draw autoregressive sampling
    makes at its position with the same seed.

    Args:
        path           [B, G] int64 drafted tokens.
        target_logits  [B, G+1, V] float32 target logits at the anchor and each drafted position.
        length         [B] int64 how many path tokens each row submitted (≤ G).
    Returns:
        accepted [B] int64 in [0, length], next_token [B] int64.
    """
    rows = None if temperature <= 0 else _row_draws(draws, path.shape[0], path.device)
    return accept_target_tokens(path, pick_tokens(target_logits, temperature, rows), length, rows)


def accept_target_tokens(
    path: torch.Tensor, x: torch.Tensor, length: torch.Tensor, draws: Sequence[RowDraws | None] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The match rule of `accept` on the target's tokens x [B, G+1] (however each row picked them):
    accepted [B] = the leading run of path == x within each row's length, next_token [B] = x at it;
    sampled rows (draws[b] not None) consume the numbers of the accepted + 1 tokens they commit."""
    G = path.shape[1]
    match = path == x[:, :G]  # [B, G]
    match &= torch.arange(G, device=path.device)[None, :] < length[:, None]
    accepted = accepted_prefix(match)  # [B] leading run of matches
    next_token = x.gather(1, accepted[:, None])[:, 0]
    if draws is not None and any(d is not None for d in draws):
        commit_rows(draws, (accepted + 1).tolist())
    return accepted, next_token


def accept_sampled(
    path: torch.Tensor,
    target_logits: torch.Tensor,
    length: torch.Tensor,
    proposal_ids: torch.Tensor,
    proposal_q: torch.Tensor,
    *,
    temperature: float,
    draws: Draws = None,
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
        draws          one RowDraws per row: the test at position j reads its test uniform, the
                       committed token its token uniform (independent of the test that stopped).
    Returns:
        accepted [B] int64 in [0, length], next_token [B] int64.
    """
    p = torch.softmax(target_logits.float() / temperature, dim=-1)  # [B, G+1, V]
    return accept_sampled_probs(path, p, length, proposal_ids, proposal_q, _row_draws(draws, path.shape[0], path.device))


def accept_sampled_probs(
    path: torch.Tensor,
    p: torch.Tensor,
    length: torch.Tensor,
    proposal_ids: torch.Tensor,
    proposal_q: torch.Tensor,
    draws: Sequence[RowDraws],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule of `accept_sampled` on the target's distributions p [B, G+1, V] (however each row
    tempered and filtered them: `sampling.target_probs`); draws: one RowDraws per row."""
    B, G = path.shape
    V = p.shape[-1]
    q = torch.zeros(B, G, V, dtype=p.dtype, device=p.device).scatter_add_(2, proposal_ids[:, :G], proposal_q[:, :G].to(p.dtype))
    p_d = p[:, :G].gather(2, path[:, :, None])[:, :, 0]  # [B, G]
    q_d = q.gather(2, path[:, :, None])[:, :, 0].clamp(min=torch.finfo(p.dtype).tiny)
    u = torch.stack([d.test_uniforms(G) for d in draws]).to(p.dtype) if G else p_d.new_zeros(B, 0)
    ok = (u < p_d / q_d) & (torch.arange(G, device=path.device)[None, :] < length[:, None])
    accepted = accepted_prefix(ok)  # [B]
    rows = torch.arange(B, device=path.device)
    at = p[rows, accepted]  # [B, V] the target's distribution where the row stops
    q_at = torch.cat([q, q.new_zeros(B, 1, V)], dim=1)[rows, accepted]  # zero past the path: the bonus draws from p
    rejected = (accepted < length)[:, None]
    residual = torch.where(rejected, (at - q_at).clamp(min=0.0), at)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, at)  # p = q exactly: never rejected
    stop = accepted.tolist()
    next_token = torch.stack([inverse_cdf(r[None], d.token_uniforms(n + 1)[n:])[0] for r, d, n in zip(residual, draws, stop)])
    commit_rows(draws, [n + 1 for n in stop])
    return accepted, next_token
