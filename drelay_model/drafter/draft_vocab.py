"""Frequency-ranked draft vocabulary (as in EAGLE-3 and FR-Spec).

On CPU the drafter's full LM head (15 slots × 49,152 rows × 576) is most of its cost. Restricting
the head to the `size` most frequent target tokens of the training data cuts that cost by V/size,
at the price of never proposing a token outside the subset. The subset is a sorted index tensor
`draft_to_target [size]` that maps a draft id back to a target id.
"""

from __future__ import annotations

import torch


def build_draft_vocab(token_counts: torch.Tensor, size: int, *, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The `size` most frequent token ids, plus any ids in `always` (e.g. EOS).

    Args:
        token_counts  [V] counts of each target token in the training labels.
        size          number of rows of the draft head (≤ V).
    Returns:
        draft_to_target [size] int64, sorted ascending.
    """
    V = token_counts.shape[0]
    if not 0 < size <= V:
        raise ValueError(f"draft vocabulary size {size} outside [1, {V}]")
    score = token_counts.double().clone()
    if always:
        score[list(always)] = float("inf")  # forced in, whatever their frequency
    # A stable sort breaks ties by id, so the mapping is deterministic.
    order = torch.argsort(-score, stable=True)[:size]
    return order.sort().values


def draft_vocab_coverage(draft_to_target: torch.Tensor, token_counts: torch.Tensor) -> float:
    """Fraction of label tokens (by count) that the draft vocabulary can propose."""
    total = token_counts.sum().item()
    return float(token_counts[draft_to_target].sum().item() / total) if total else 0.0
