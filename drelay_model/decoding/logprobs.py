"""The target's log-probabilities of committed tokens (OpenAI's `logprobs` / `top_logprobs`).

For a committed token t at position j, the value is the target's own

    log p(t | prefix) = log_softmax(z_j)[t] = z_j[t] − logsumexp(z_j)

of the raw logits z_j at that position (before temperature, top-p, top-k), as vLLM returns by
default. Under speculative decoding the logits come from the round's one verify forward:
position j ∈ [0, n] of [anchor, path] predicts the token after it, so the n accepted drafts take
positions 0 … n−1 and the bonus / replacement token takes position n. The first token of a
request takes the prefill's logits at the prompt's last position. No extra target forward runs.

Rows are asked per request: k ≥ 0 alternatives (the k most likely tokens, most likely first;
0 = the chosen token's value alone), or None (not asked: that row costs nothing).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One committed token: its id and log-probability, and the k most likely ids with theirs
    (`top`, most likely first; ties in the target's order)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


RowLogprobs = list[TokenLogprob] | None  # one row's committed tokens, in order; None: not asked


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor, ks: Sequence[int | None]
) -> list[RowLogprobs]:
    """Log-probabilities of given tokens at given positions, for the rows that asked.

    Args:
        logits  [R, N, V] the target's logits (any float dtype; computed in float32).
        tokens  [R, N] int64 the token at each position (entries past a row's count are ignored).
        counts  [R] int64 how many leading positions of each row hold committed tokens (≥ 1).
        ks      R entries: alternatives per row (k ≥ 0), or None for a row that did not ask.
    Returns:
        R entries: counts[r] TokenLogprobs for a row that asked, None otherwise.
    """
    asked = [r for r, k in enumerate(ks) if k is not None]
    out: list[RowLogprobs] = [None] * len(ks)
    if not asked:
        return out
    rows = torch.tensor(asked, device=logits.device)
    n = counts[rows].tolist()  # one host copy: positions each asking row commits
    z = logits[rows, : max(n)].float()  # [A, N', V]
    lse = torch.logsumexp(z, dim=-1)  # [A, N'] log Σ_v exp z_v
    chosen_ids = tokens[rows, : max(n)]  # [A, N']
    chosen = z.gather(2, chosen_ids[..., None])[..., 0] - lse  # [A, N'] log p(token)
    k_max = min(max(ks[r] for r in asked), z.shape[-1])
    top_ids_l = top_lp_l = [[[]] * max(n)] * len(asked)
    if k_max:
        top_z, top_ids = z.topk(k_max, dim=-1)  # [A, N', k_max] sorted, most likely first
        top_ids_l, top_lp_l = top_ids.tolist(), (top_z - lse[..., None]).tolist()  # log-softmax: z shifted by lse
    ids_l, lp_l = chosen_ids.tolist(), chosen.tolist()
    for a, r in enumerate(asked):
        k = ks[r]
        out[r] = [TokenLogprob(ids_l[a][j], lp_l[a][j], tuple(zip(top_ids_l[a][j][:k], top_lp_l[a][j][:k]))) for j in range(n[a])]
    return out


def committed_tokens(path: torch.Tensor, accepted: torch.Tensor, next_token: torch.Tensor) -> torch.Tensor:
    """The token committed at each verify position: path [R, G], accepted [R], next_token [R] →
    [R, G+1] with path[:, j] for j < accepted and next_token at j = accepted (later entries unused)."""
    tokens = torch.cat([path, next_token[:, None]], dim=1)  # [R, G+1]
    return tokens.scatter(1, accepted[:, None], next_token[:, None])


def round_logprobs(
    logits: torch.Tensor, path: torch.Tensor, accepted: torch.Tensor, next_token: torch.Tensor, ks: Sequence[int | None]
) -> list[RowLogprobs]:
    """A round's committed tokens (accepted drafts + the target's token) with their log-probabilities.

    logits [R, G+1, V] of the verify forward over [anchor, path]; path [R, G]; accepted [R];
    next_token [R] → per row accepted + 1 TokenLogprobs (None for rows that did not ask). The
    caller keeps as many as it commits (EOS, stop strings and the budget may end a row earlier).
    """
    return token_logprobs(logits, committed_tokens(path, accepted, next_token), accepted + 1, ks)


def first_token_logprobs(last_logits: torch.Tensor, first: torch.Tensor, ks: Sequence[int | None]) -> list[RowLogprobs]:
    """The prefill token: last_logits [B, V] at each prompt's last position, first [B] → one
    TokenLogprob per asking row."""
    if all(k is None for k in ks):
        return [None] * len(ks)
    ones = torch.ones(first.shape[0], dtype=torch.long, device=first.device)
    return token_logprobs(last_logits[:, None], first[:, None], ones, ks)
