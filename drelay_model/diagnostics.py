"""Pool diagnostics from greedy replay traces (DRelay §3 and Appendix A) — pure tensor math.

One traced round holds the drafted pool, the path the selector served and the target's reference
tokens after the anchor (its greedy continuation under the verified prefix):

    cand  [N, H, K] int64   pool per slot; cand[..., 0] is the base (native argmax) token
    path  [N, H]    int64   served path, padded with PATH_PAD past the selector's length
    ref   [N, H]    int64   reference tokens, padded with REF_PAD past the end of the continuation

Definitions (A = accepted drafts before the first error of a path, y = reference):
    first error      the first slot i < min(len(path), len(y)) with path_i != y_i (none: no error)
    coverage         c_i = 1[y_i in pool_i] at that slot; reported for the served path and for the
                     base path (cand[..., 0]), each over the rounds that have such an error
    one-edit gain    replacing only the served error by y_A (possible iff covered) lengthens the
                     accepted prefix by 1 + R, R = consecutive served matches right after A; averaged
                     over *complete* blocks (all H reference tokens exist), 0 where the replacement is
                     unavailable or there is no error
    efficiency       τ / oracle τ, oracle τ from `replay(..., oracle=True)` over the same pool

Counts (not ratios) are kept so results from many prompts merge exactly (`PoolDiagnostics.__add__`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from drelay_model.decoding.verify import accepted_prefix

PATH_PAD = -1
REF_PAD = -2  # differs from PATH_PAD so padding never "matches"


@dataclass(frozen=True)
class PoolDiagnostics:
    """Counters over traced rounds; ratios are properties (0.0 when undefined)."""

    rounds: int = 0
    complete_blocks: int = 0
    base_errors: int = 0
    base_covered: int = 0
    served_errors: int = 0
    served_covered: int = 0
    one_edit_gain_sum: float = 0.0

    def __add__(self, other: "PoolDiagnostics") -> "PoolDiagnostics":
        return PoolDiagnostics(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    @property
    def coverage_first_error(self) -> float:
        """P(y in pool | first served error): how often a one-token repair is possible."""
        return self.served_covered / self.served_errors if self.served_errors else 0.0

    @property
    def coverage_first_base_error(self) -> float:
        """P(y in pool | first error of the base argmax path)."""
        return self.base_covered / self.base_errors if self.base_errors else 0.0

    @property
    def one_edit_gain(self) -> float:
        """Mean accepted-length gain of the one-edit oracle over complete blocks (the paper's 1 + R)."""
        return self.one_edit_gain_sum / self.complete_blocks if self.complete_blocks else 0.0


def pad_rounds(
    rounds: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stack per-round (cand [H, K], path [G ≤ H], ref [R ≤ H]) into padded batch tensors.

    Returns:
        cand [N, H, K], path [N, H] (PATH_PAD-padded), ref [N, H] (REF_PAD-padded), all int64.
    """
    if not rounds:
        raise ValueError("no rounds to pad")
    H, K = rounds[0][0].shape
    N = len(rounds)
    cand = torch.stack([c.to(torch.long) for c, _, _ in rounds])  # [N, H, K]
    path = torch.full((N, H), PATH_PAD, dtype=torch.long)
    ref = torch.full((N, H), REF_PAD, dtype=torch.long)
    for n, (_, p, r) in enumerate(rounds):
        path[n, : len(p)] = p[:H]
        ref[n, : len(r)] = r[:H]
    return cand, path, ref


def accepted_length(path: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Leading matches of path with ref: [N, H], [N, H] → [N] int64 (padding never matches)."""
    return accepted_prefix(path == ref)


def first_error(path: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot of the first error and whether the round has one.

    An error needs both a proposal and a reference token at that slot: a path that runs out (or a
    continuation that ends) before any mismatch has no error.
    Returns:
        A [N] int64 (accepted drafts = first error slot when it exists), has_error [N] bool.
    """
    A = accepted_length(path, ref)
    G = (path != PATH_PAD).sum(dim=1)
    R = (ref != REF_PAD).sum(dim=1)
    return A, (A < G) & (A < R)


def covered_at(cand: torch.Tensor, ref: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """Whether ref[n, slot[n]] is in pool cand[n, slot[n]]: → [N] bool (False where slot ≥ H)."""
    N, H, K = cand.shape
    s = slot.clamp(max=H - 1)
    pool = cand[torch.arange(N), s]  # [N, K]
    y = ref.gather(1, s[:, None])  # [N, 1]
    return (pool == y).any(dim=1) & (slot < H)


def one_edit_gain(cand: torch.Tensor, path: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-round gain of fixing only the first served error, and which rounds are complete blocks.

    gain = 1 + R if the served path has an error at A and y_A is in pool_A, else 0;
    R = number of consecutive matches path_j == y_j for j = A+1, A+2, … (stops at the next error).
    Returns:
        gain [N] float64, complete [N] bool (all H reference tokens exist).
    """
    N, H, _ = cand.shape
    A, has_error = first_error(path, ref)
    covered = covered_at(cand, ref, A) & has_error
    j = torch.arange(H)[None, :]  # [1, H]
    ok = (path == ref) | (j <= A[:, None])  # pretend the error slot is fixed
    run = accepted_prefix(ok)  # [N] = A + 1 + R when there is an error
    gain = torch.where(covered, (run - A).double(), torch.zeros(N, dtype=torch.float64))
    complete = (ref != REF_PAD).sum(dim=1) == H
    return gain, complete


def diagnose_rounds(cand: torch.Tensor, path: torch.Tensor, ref: torch.Tensor) -> PoolDiagnostics:
    """All counters for a batch of traced rounds (shapes as in the module docstring)."""
    N, H, _ = cand.shape
    assert path.shape == (N, H) and ref.shape == (N, H), (cand.shape, path.shape, ref.shape)
    A_srv, err_srv = first_error(path, ref)
    base = cand[:, :, 0]  # [N, H]
    A_base, err_base = first_error(base, ref)
    gain, complete = one_edit_gain(cand, path, ref)
    return PoolDiagnostics(
        rounds=N,
        complete_blocks=int(complete.sum()),
        base_errors=int(err_base.sum()),
        base_covered=int((covered_at(cand, ref, A_base) & err_base).sum()),
        served_errors=int(err_srv.sum()),
        served_covered=int((covered_at(cand, ref, A_srv) & err_srv).sum()),
        one_edit_gain_sum=float(gain[complete].sum()),
    )


def selection_efficiency(tau: float, oracle_tau: float) -> float:
    """τ / oracle τ: the share of the pool's attainable acceptance a selector realises (0 if undefined)."""
    return tau / oracle_tau if oracle_tau > 0 else 0.0


# ---- §3.2: do later predictions support the right candidate? ----------------------------------------
# Samples: rounds whose served path has a first error at slot A, the target's token y_A is in the pool
# at A, and the next `span` drafts after A are all correct. For each pool candidate v at A, the frozen
# target scores the drafted suffix given the verified prefix and v:
#     score(v) = Σ_{t=1..span} log p_target(path_{A+t} | prefix, y_<A, v, path_{A+1..A+t-1})
# The best-scoring candidate is the one "the later predictions support"; accuracy = P(it is y_A). The
# control replaces the suffix with "a suffix from another prompt" (`other_prompt_controls`): the gap is
# the context-dependent evidence.


@dataclass(frozen=True)
class ContinuationEvidence:
    """Counters of the §3.2 test; merge with `+`."""

    samples: int = 0
    real_correct: int = 0
    control_correct: int = 0

    def __add__(self, other: "ContinuationEvidence") -> "ContinuationEvidence":
        return ContinuationEvidence(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    @property
    def real_accuracy(self) -> float:
        return self.real_correct / self.samples if self.samples else 0.0

    @property
    def control_accuracy(self) -> float:
        return self.control_correct / self.samples if self.samples else 0.0


def continuation_samples(
    cand: torch.Tensor, path: torch.Tensor, ref: torch.Tensor, span: int = 4
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which rounds qualify for the §3.2 test, and their first-error slot.

    cand [N, H, K], path/ref [N, H] (padded as in `pad_rounds`) → (ok [N] bool, A [N] int64).
    """
    N, H, _ = cand.shape
    A, has_error = first_error(path, ref)
    j = torch.arange(H)[None, :]
    after = (j > A[:, None]) & (j <= A[:, None] + span)  # [N, H] the span slots after A
    suffix_ok = ((path == ref) | ~after).all(dim=1) & (A + span < H)
    return has_error & covered_at(cand, ref, A) & suffix_ok, A


def other_prompt_controls(prompt_ids: Sequence[int]) -> list[int | None]:
    """The control of each §3.2 sample: the index of the next sample, cyclically, that comes from a
    different prompt (`prompt_ids[i]` = the prompt sample i was drawn from); None when every sample
    shares sample i's prompt, so no control exists."""
    n = len(prompt_ids)
    controls: list[int | None] = []
    for i in range(n):
        after = ((i + step) % n for step in range(1, n))
        controls.append(next((j for j in after if prompt_ids[j] != prompt_ids[i]), None))
    return controls


@torch.no_grad()
def continuation_scores(target, prefix: Sequence[int], candidates: torch.Tensor, suffix: Sequence[int]) -> torch.Tensor:
    """Target log-probability of `suffix` after prefix + each candidate: [K] float32 (one suffix of
    `continuation_scores_per_suffix`)."""
    return continuation_scores_per_suffix(target, prefix, candidates, [suffix])[0]


@torch.no_grad()
def continuation_scores_per_suffix(
    target, prefix: Sequence[int], candidates: torch.Tensor, suffixes: Sequence[Sequence[int]]
) -> torch.Tensor:
    """Target log-probability of each suffix after prefix + each candidate (the real suffix and its
    control share one prefix, so it is prefilled once).

    The prefix is prefilled once (logits at its last position only: the scores need none of them) and
    its cache copied to M·K rows; then one forward over [candidate, suffix] per row. prefix: P ≥ 1
    verified tokens; candidates [K] int64; suffixes: M suffixes of S tokens each. → [M, K] float32.
    """
    K, P, M = len(candidates), len(prefix), len(suffixes)
    S = len(suffixes[0])
    if any(len(s) != S for s in suffixes):
        raise ValueError(f"suffixes must have one length, got {[len(s) for s in suffixes]}")
    device = target.embed_weight.device
    cache = target.new_cache(1, P + 1 + S)
    last = torch.full((1, 1), P - 1, dtype=torch.long, device=device)
    target(torch.as_tensor([list(prefix)], device=device), cache, logits_at=last)
    cache.select_rows(torch.zeros(M * K, dtype=torch.long, device=device))  # M·K copies of the prefix
    ids = torch.empty(M, K, 1 + S, dtype=torch.long, device=device)
    ids[:, :, 0] = candidates.to(device)  # row m·K + k: candidate k, then suffix m
    ids[:, :, 1:] = torch.as_tensor([list(s) for s in suffixes], device=device)[:, None, :]
    ids = ids.reshape(M * K, 1 + S)
    at = torch.arange(S, device=device).expand(M * K, S)  # new positions 0..S−1 predict the suffix tokens
    logp = torch.log_softmax(target(ids, cache, logits_at=at).logits.float(), dim=-1)  # [M·K, S, V]
    return logp.gather(-1, ids[:, 1:, None])[..., 0].sum(dim=1).reshape(M, K)


def supported_is_correct(scores: torch.Tensor, candidates: torch.Tensor, correct: int) -> bool:
    """Whether the best-scoring candidate is the target's token (ties: the earlier, higher-q one)."""
    return int(candidates[int(scores.argmax())]) == int(correct)
