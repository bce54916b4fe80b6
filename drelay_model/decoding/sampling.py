"""The per-row sampling and acceptance rule of every decode (settings: `GenerationConfig`).

A request samples from the target's *filtered* conditional
    p̃(v) ∝ softmax(logits / T)(v) · [v in top-k] · [v in the smallest top-p nucleus]
(T = 0: argmax). Verification stays lossless with respect to p̃ by the argument of `verify.accept`:
the target's token x_j at every verified position is the draw from p̃ at that output position's
uniform (`draws.py`), and a draft is accepted only while it equals x_j; the numbers of positions
past the first mismatch are not consumed, so a seeded request commits what it would alone, undrafted.
A row that drew its path from the drafter's pool (`GenerationConfig.samples_paths`, a selector that
samples) is tested against that proposal instead (`verify.accept_sampled_probs` on p̃): an exact
draw from p̃, but not the undrafted one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from drelay_model.decoding.draws import RowDraws, inverse_cdf
from drelay_model.decoding.generation import GenerationConfig
from drelay_model.decoding.verify import accept_sampled_probs, accept_target_tokens
from drelay_model.selectors.base import Selection


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


def target_probs(logits: torch.Tensor, settings: Sequence[GenerationConfig]) -> torch.Tensor:
    """The target's filtered conditionals p̃: logits [R, T, V] → [R, T, V] float32, row r under
    settings[r] (all T > 0); one batched softmax when every row has the same knobs."""
    first = settings[0]
    knobs = (first.temperature, first.top_k, first.top_p)
    if all((s.temperature, s.top_k, s.top_p) == knobs for s in settings):
        return torch.softmax(filtered_logits(logits.float(), first), dim=-1)
    return torch.stack([torch.softmax(filtered_logits(x.float(), s), dim=-1) for x, s in zip(logits, settings)])


def accept_rows(
    path: torch.Tensor,
    target_logits: torch.Tensor,
    length: torch.Tensor,
    proposal: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    settings: Sequence[GenerationConfig],
    draws: Sequence[RowDraws | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The acceptance rule, each row under its own settings: a row whose path was sampled from the
    round's proposal (given, and the row `samples_paths`) takes the speculative-sampling rule on
    its filtered conditional (`verify.accept_sampled_probs`); every other row the match rule on the
    tokens it picks (`verify.accept_target_tokens`: argmax, or its seeded draw from p̃).

    Args:
        path [R, G] int64, target_logits [R, G+1, V] float32, length [R] int64; proposal: (pool ids
        [R, H, K], q [R, H, K]) of a sampled path, or None; settings/draws: one per row (draws None
        for greedy rows).
    Returns:
        accepted [R] int64 in [0, length], next_token [R] int64.
    """
    sampled = [proposal is not None and s.samples_paths for s in settings]
    if all(sampled):
        return accept_sampled_probs(path, target_probs(target_logits, settings), length, *proposal, draws)
    if not any(sampled):
        return _match_rows(path, target_logits, length, settings, draws)
    # A mixed batch: each group under its own rule, the results put back in row order.
    groups = [[i for i, s in enumerate(sampled) if s == flag] for flag in (False, True)]
    accepted = torch.empty_like(length)
    next_token = torch.empty_like(length)
    for flag, rows in zip((False, True), groups):
        idx = torch.tensor(rows, dtype=torch.long, device=path.device)
        sub_settings, sub_draws = [settings[i] for i in rows], [draws[i] for i in rows]
        if flag:
            ids, q = proposal
            probs = target_probs(target_logits[idx], sub_settings)
            a, x = accept_sampled_probs(path[idx], probs, length[idx], ids[idx], q[idx], sub_draws)
        else:
            a, x = _match_rows(path[idx], target_logits[idx], length[idx], sub_settings, sub_draws)
        accepted[idx], next_token[idx] = a, x
    return accepted, next_token


def _match_rows(path, target_logits, length, settings, draws) -> tuple[torch.Tensor, torch.Tensor]:
    """The match rule on each row's own pick (argmax for greedy rows, else the seeded draw from p̃)."""
    x = target_logits.argmax(dim=-1)  # [R, G+1] greedy rows need nothing more
    for i, p in enumerate(settings):
        if not p.greedy:
            x[i] = pick_row(target_logits[i], p, draws[i])
    return accept_target_tokens(path, x, length, draws)


def path_sampler(settings: Sequence[GenerationConfig], draws: Sequence[RowDraws | None], device: torch.device):
    """A round's path sampler when some row `samples_paths` (T > 0 with `draft_sampling`), else None:
    those rows draw their path at their own temperature from their own proposal numbers
    (`Selector.sample`); the other rows of a mixed batch keep the selector's deterministic path
    (`accept_rows` tests each row by the rule that matches how its path was chosen)."""
    flags = [s.samples_paths for s in settings]
    if not any(flags):
        return None
    temps = [s.temperature if f else 1.0 for s, f in zip(settings, flags)]
    T = temps[0] if all(flags) and len(set(temps)) == 1 else torch.tensor(temps, device=device)
    spare = None if all(flags) else torch.Generator(device=device)  # the unused draws of other rows
    generators = [d.proposals if f else spare for d, f in zip(draws, flags)]

    def sample(selector, block, ctx) -> Selection:
        drawn = selector.sample(block, ctx, temperature=T, generators=generators)
        if spare is None:
            return drawn
        chosen, keep = selector.select(block, ctx), torch.tensor(flags, device=device)  # keep [R]
        return Selection(
            pool_index=torch.where(keep[:, None], drawn.pool_index, chosen.pool_index),
            path_ids=torch.where(keep[:, None], drawn.path_ids, chosen.path_ids),
            length=torch.where(keep, drawn.length, chosen.length),
            proposal_q=drawn.proposal_q,
        )

    return sample
