"""Which queued prompts prefill together: length groups with little padding.

A prefill forward is one right-padded [B, P] batch, P the longest prompt, and its cost follows the
padded tokens B·P, not the prompts' own: 16 GSM8K chat prompts of 56–140 tokens (1,512 tokens, 2,240
padded) prefilled in 3.2 s as one batch, in 2.3 s as four batches of four sorted by length, and in
2.7 s one at a time (a forward of a few dozen tokens leaves the matmuls short of work). So the
admitted prompts are sorted by length, longest first, and each group takes the next prompt while

    P_group · (n + 1) ≤ (1 + waste) · (tokens of the group's prompts + the new one's)

(the group's longest prompt sets P_group). Rows are independent of each other, so the grouping
changes no output; groups merge into the running batch one after another (`BatchState.merge`).
"""

from __future__ import annotations

PREFILL_WASTE = 0.15  # padded ÷ real tokens a group may reach


def prefill_groups(lengths: list[int], waste: float = PREFILL_WASTE) -> list[list[int]]:
    """Indices into `lengths`, in groups (each longest first) whose padded tokens stay within
    (1 + waste) of their real tokens; every index appears once."""
    if waste < 0:
        raise ValueError(f"waste must be ≥ 0, got {waste}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    real = 0
    for i in order:
        if groups:
            longest = lengths[groups[-1][0]]
            if longest * (len(groups[-1]) + 1) <= (1 + waste) * (real + lengths[i]):
                groups[-1].append(i)
                real += lengths[i]
                continue
        groups.append([i])
        real = lengths[i]
    return groups
