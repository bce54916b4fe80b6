"""The cost policy's measured round costs over batch sizes (`cost_policy/surface.py`, `measure.py`) and
the batch-aware plan they price (`policy.py`): interpolation, monotone fits, files and their versions,
and the plan at b rows."""

from __future__ import annotations

import json

import pytest
import torch

from drelay_model.decoding import GenerationConfig, SpeculativeEngine
from drelay_model.decoding.cost_policy import (
    COSTS_VERSION,
    CostPolicy,
    RoundCosts,
    StaleCosts,
    isotonic_2d,
    measure_costs,
    surface_batches,
)
from drelay_model.decoding.stats import DecodeStats
from drelay_model.errors import DRelayError
from drelay_model.selectors import default_registry
from tests.model.test_verify_length import set_counts

H = 4


def surface(per_draft: dict[int, float], ar_per_row: float = 10.0, draft_ms: float = 1.0) -> RoundCosts:
    """verify(b, t) = ar_per_row·b + per_draft[b]·(t − 1): the cost of each verified draft per round at b rows."""
    sizes = tuple(sorted(per_draft))
    return RoundCosts(
        verify_ms=[[ar_per_row * b + per_draft[b] * (t - 1) for t in range(1, H + 2)] for b in sizes],
        draft_slots_ms=[[draft_ms * b] * H for b in sizes],
        select_ms=0.1,
        select_slot_ms=0.0,
        extend_ms=0.1,
        batch_sizes=sizes,
    )


def test_the_grid_of_batch_sizes_covers_1_to_max_batch():
    assert surface_batches(1) == (1,)
    assert surface_batches(16) == (1, 2, 4, 8, 16)
    assert surface_batches(12) == (1, 2, 4, 8, 12)
    with pytest.raises(DRelayError, match="max_batch"):
        surface_batches(0)


def test_terms_are_linear_in_b_between_grid_points_and_extrapolate_the_last_slope():
    c = surface({1: 1.0, 2: 2.0, 4: 8.0})
    assert c.verify(1, 1) == 10.0 and c.verify(3, 1) == 12.0  # b = 1 is a grid point: exact
    assert c.verify(1, 3) == pytest.approx(30.0)  # halfway between 20 (b = 2) and 40 (b = 4)
    assert c.verify(2, 3) == pytest.approx((22.0 + 48.0) / 2)
    assert c.verify(1, 8) == pytest.approx(80.0)  # the last segment's slope (10 ms per row) continues
    assert c.draft_ms(2, decided=2, batch=3) == pytest.approx(3.0 + 0.1 + 0.1)
    assert c.draft_ms(0, batch=4) == 0.0
    assert c.max_batch == 4 and c.max_slots == H


def test_a_one_point_surface_prices_every_batch_size_as_one_row():
    c = RoundCosts(verify_ms=(10.0, 12.0), draft_slots_ms=(1.0,), select_ms=0.5)
    assert c.batch_sizes == (1,) and c.verify(2, 16) == 12.0 and c.draft_ms(1, batch=16) == 1.5


def test_isotonic_2d_is_monotone_in_both_axes():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        noisy = (torch.arange(5)[:, None] * 3.0 + torch.arange(6)[None] + 4 * torch.rand(5, 6, generator=g)).tolist()
        fit = isotonic_2d(noisy)
        assert all(a <= b for row in fit for a, b in zip(row, row[1:]))
        assert all(fit[i][t] <= fit[i + 1][t] for i in range(4) for t in range(6))


def test_surfaces_save_load_and_stale_or_bad_files_are_one_line_errors(tmp_path):
    c = surface({1: 1.0, 2: 2.0, 4: 8.0})
    c.save(tmp_path / "c.json")
    assert RoundCosts.load(tmp_path / "c.json") == c
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"verify_ms": [10.0, 11.0], "block_ms": 2.0, "head_ms": 0.5, "select_ms": 3.0}))
    with pytest.raises(StaleCosts, match=f"version 1 < {COSTS_VERSION}"):
        RoundCosts.load(old)
    raw = json.loads((tmp_path / "c.json").read_text())
    bad_files = {
        "garbage": "{not json",
        "a list": "[1, 2]",
        "missing": json.dumps({k: v for k, v in raw.items() if k != "extend_ms"}),
        "short row": json.dumps({**raw, "verify_ms": [raw["verify_ms"][0], raw["verify_ms"][1][:-1], raw["verify_ms"][2]]}),
        "unsorted": json.dumps({**raw, "batch_sizes": [1, 4, 2]}),
        "negative": json.dumps({**raw, "select_ms": [0.1, -1.0, 0.1]}),
    }
    for name, text in bad_files.items():
        path = tmp_path / f"{name}.json"
        path.write_text(text)
        with pytest.raises(DRelayError) as info:
            RoundCosts.load(path)
        assert "\n" not in str(info.value), name
    with pytest.raises(DRelayError, match="batch_sizes"):
        RoundCosts(verify_ms=((10.0,), (11.0,)), draft_slots_ms=((), ()), select_ms=0.0, batch_sizes=(2, 4))


def test_timed_widths_and_the_line_between_them():
    from drelay_model.decoding.cost_policy.surface import draft_widths, fill_linear, verify_widths

    assert verify_widths(15) == (1, 2, 3, 5, 9, 16) and draft_widths(15) == (1, 2, 4, 8, 15)
    assert verify_widths(0) == (1,) and draft_widths(0) == () and draft_widths(1) == (1,)
    for H in range(1, 40):
        for points, n in ((verify_widths(H), H + 1), (draft_widths(H), H)):
            assert points[0] == 1 and points[-1] == n and list(points) == sorted(set(points))
            line = [3.0 + 0.5 * w for w in range(1, n + 1)]  # a cost linear in the width is recovered exactly
            assert fill_linear(points, [line[w - 1] for w in points], n) == pytest.approx(line)


def test_measure_costs_times_every_batch_size_within_its_budget(target, make_drafter):
    drafter = make_drafter(target)
    selector = default_registry().create("native", drafter=drafter)
    c = measure_costs(target, drafter, selector, batch_sizes=(1, 2, 4), context_len=16, reps=50, budget_s=0.01)
    Hd = drafter.config.num_slots
    assert c.batch_sizes == (1, 2, 4) and len(c.verify_ms) == 3 and all(len(r) == Hd + 1 for r in c.verify_ms)
    for table in (c.verify_ms, c.draft_slots_ms):
        assert all(list(r) == sorted(r) for r in table)
        assert all(table[i][t] <= table[i + 1][t] for i in range(2) for t in range(len(table[0])))
    assert all(t > 0 for t in c.extend_ms) and len(c.select_ms) == 3
    with pytest.raises(DRelayError, match="reps"):
        measure_costs(target, drafter, selector, reps=0)
    with pytest.raises(DRelayError, match="batch_sizes"):
        measure_costs(target, drafter, selector, batch_sizes=(2,))


def test_the_plan_drafts_alone_and_runs_ar_rounds_when_verify_grows_steeply_with_b():
    """Each verified draft per row costs 5% of an AR step alone but a whole AR step at 16 rows (the
    forward is compute-bound there): at â = 0.5 a drafted round pays at b = 1 and not at b = 16
    (where the plan returns 0, an AR round for the batch)."""
    c = surface({1: 0.5, 4: 10.0, 16: 160.0})
    policy = CostPolicy(c, H)
    set_counts(policy, [100.0] * H, [50.0] * H)
    assert policy.plan(batch=1) > 0
    assert policy.plan(batch=16) == 0
    flat = CostPolicy(surface({1: 0.5, 4: 2.0, 16: 40.0}), H)  # a quarter of an AR step at 16: drafting pays
    set_counts(flat, [100.0] * H, [50.0] * H)
    assert flat.plan(batch=16) > 0


def test_choose_returns_one_length_for_the_batch():
    """The verify forward is as wide as the longest row: the batch verifies one length G, the best for
    the sum of its rows' expected tokens; sure rows carry a hopeless one along."""
    policy = CostPolicy(surface({1: 0.5, 2: 1.0}), H)
    q = torch.stack([torch.full((H,), 0.999), torch.full((H,), 0.01)])
    lengths = policy.choose(q, H)
    assert lengths.tolist() == [H, H]
    assert policy.choose(torch.full((2, H), 0.01), H).tolist() == [0, 0]


def test_time_scales_compare_a_round_with_the_surface_at_its_batch_size():
    """A 4-row verify measured at what the surface says for 4 rows leaves the scale at 1 (it is not
    read as 4× slower than one row)."""
    c = surface({1: 1.0, 4: 4.0})
    policy = CostPolicy(c, H)
    for _ in range(30):
        policy.observe_times(
            verify_width=3, verify_ms=c.verify(3, 4), head_slots=H, decided=H, draft_ms=c.draft_ms(H, H, 4), batch=4
        )
    assert policy.verify_ms(3, 4) == pytest.approx(c.verify(3, 4)) and policy.draft_ms(H, H, 4) == pytest.approx(
        c.draft_ms(H, H, 4)
    )


def test_stats_count_drafted_rounds_and_verified_drafts(target, make_drafter, prompts_of):
    drafter = make_drafter(target, top_k=16)
    Hd = drafter.config.num_slots
    c = RoundCosts(verify_ms=tuple(10.0 + 0.1 * i for i in range(Hd + 1)), draft_slots_ms=(0.1,) * Hd, select_ms=0.01)
    out = SpeculativeEngine(target, drafter, costs=c).generate(
        prompts_of(target.vocab_size, (5, 8, 3)), GenerationConfig(max_new_tokens=12)
    )
    s = out.stats
    assert 0 < s.drafted_rounds <= s.rounds and s.drafted_steps <= s.steps
    assert 0 < s.verified_drafts <= Hd * s.drafted_rounds and s.mean_verify_length == s.verified_drafts / s.drafted_rounds
    again = DecodeStats.from_dict(s.to_dict())
    assert (again.drafted_rounds, again.verified_drafts) == (s.drafted_rounds, s.verified_drafts)
    ar = SpeculativeEngine(target).generate(prompts_of(target.vocab_size, (5,)), GenerationConfig(max_new_tokens=6)).stats
    assert ar.drafted_rounds == ar.verified_drafts == 0 and ar.mean_verify_length == 0.0
