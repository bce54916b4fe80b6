"""Per-prompt replay counts: τ per row from the round hook, and Σ committed ÷ Σ rounds with its
interval over the rows (training's validation and the eval runner share this)."""

from __future__ import annotations

from types import SimpleNamespace

from pipelines.common.replay_counts import ReplayCounts


def test_counts_give_tau_per_row_and_the_pooled_ratio_with_its_interval():
    counts = ReplayCounts(3)
    rounds = {0: [1, 2, 1], 1: [3, 3], 2: [1, 1, 1, 1]}  # committed tokens per round, per row
    for row, committed in rounds.items():
        for c in committed:
            counts.add(SimpleNamespace(row=row, committed=c))
    assert counts.rounds == [3, 2, 4] and counts.committed == [4, 6, 4]
    assert [counts.tau(r) for r in range(3)] == [4 / 3, 3.0, 1.0]
    iv = counts.tau_interval()
    assert iv.point == 14 / 9  # Σ committed ÷ Σ rounds, not the mean of the rows' τ
    assert iv.low <= iv.point <= iv.high and iv.high - iv.low > 0


def test_two_replays_of_the_same_rows_give_a_paired_tau_ratio():
    native, selector = ReplayCounts(3), ReplayCounts(3)
    for counts, per_row in ((native, [(4, 3), (6, 4), (4, 4)]), (selector, [(4, 2), (6, 3), (4, 3)])):
        for row, (committed, rounds) in enumerate(per_row):
            for c in [committed - rounds + 1] + [1] * (rounds - 1):  # `rounds` rounds committing `committed`
                counts.add(SimpleNamespace(row=row, committed=c))
    gain = selector.tau_ratio(native)
    assert gain.point == (14 / 8) / (14 / 11)  # pooled τ over pooled τ
    assert 1.0 < gain.low <= gain.point <= gain.high  # every row gains: resolved above 1
