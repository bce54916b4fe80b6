"""The one owner of decode settings (`GenerationConfig`), the accepted-prefix length, and mergeable,
serialisable `DecodeStats`."""

from __future__ import annotations

import json
import math

import pytest
import torch

from drelay_model.decoding import DEFAULT_MAX_NEW_TOKENS, DecodeStats, GenerationConfig, SettingsError
from drelay_model.decoding.batcher import RequestStats
from drelay_model.decoding.verify import accepted_prefix
from drelay_model.errors import DRelayError


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_new_tokens": 0}, "max_new_tokens must be an integer ≥ 1"),
        ({"max_new_tokens": True}, "max_new_tokens must be an integer ≥ 1"),
        ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer ≥ 1"),
        ({"temperature": -0.1}, "temperature must be in"),
        ({"temperature": math.nan}, "temperature must be in"),
        ({"temperature": 101.0}, "temperature must be in"),
        ({"temperature": math.inf}, "temperature must be in"),
        ({"top_p": 0.0}, "top_p must be in"),
        ({"top_p": math.nan}, "top_p must be in"),
        ({"top_p": 1.5}, "top_p must be in"),
        ({"top_k": -1}, "top_k must be an integer"),
        ({"top_k": 2.0}, "top_k must be an integer"),
        ({"seed": 1.5}, "seed must be an integer"),
    ],
)
def test_bad_settings_are_one_line_errors_naming_the_field(kwargs, message):
    with pytest.raises(SettingsError, match=message) as caught:
        GenerationConfig(**kwargs)
    assert caught.value.field == next(iter(kwargs)) and isinstance(caught.value, DRelayError)
    assert str(caught.value) == f"{caught.value.field} {caught.value.detail}"


def test_defaults_greedy_and_context_budget():
    g = GenerationConfig()
    assert g.max_new_tokens == DEFAULT_MAX_NEW_TOKENS and g.greedy and not GenerationConfig(temperature=0.5).greedy
    assert g.with_seed(7).seed == 7 and g.with_seed(7).max_new_tokens == g.max_new_tokens
    g = GenerationConfig(max_new_tokens=10)
    # P + 10 new tokens + H = 15 draft slots + anchor + bonus must fit 64 positions: P ≤ 64 − 10 − 15 − 2 = 37
    assert g.prompt_limit(64, 15) == 37 and g.kv_positions(37, 15) == 64
    g.check_prompt(37, max_positions=64, num_slots=15)
    with pytest.raises(DRelayError, match="prompt 3 has 38 tokens.*at most 37 with max_new_tokens=10"):
        g.check_prompt(38, max_positions=64, num_slots=15, what="prompt 3")
    assert g.check_prompt(37, max_positions=64, num_slots=15) == 64  # the KV positions its row needs


def test_accepted_prefix_is_the_leading_run_of_matches():
    match = torch.tensor([[True, True, False, True], [False, True, True, True], [True, True, True, True]])
    assert accepted_prefix(match).tolist() == [2, 0, 4]
    assert int(accepted_prefix(torch.tensor([True, False]))) == 1  # 1-D: one round
    assert accepted_prefix(torch.zeros(2, 0, dtype=torch.bool)).tolist() == [0, 0]


def test_a_batch_and_its_requests_count_rounds_by_one_rule():
    """DecodeStats (per step) and RequestStats (per request) see the same row-rounds and agree: the
    requests' histograms sum to the batch's, EOS-truncated rounds (4 accepted, 2 committed) included."""
    batch = DecodeStats(num_slots=4)
    requests = [RequestStats(num_slots=4, prompt_tokens=3) for _ in range(2)]
    steps = [([0, 3], [1, 4], [4, 4]), ([4, 2], [2, 3], None), ([1, 4], [2, 5], [2, 4])]  # accepted, committed, verified
    for accepted, committed, verified in steps:
        batch.record_round(accepted, committed, verified)
        for i, r in enumerate(requests):
            r.record_round(accepted[i], committed[i], None if verified is None else verified[i])
    assert batch.accept_hist.tolist() == [a + b for a, b in zip(*(r.accept_hist for r in requests))] == [1, 2, 1, 1, 1]
    assert batch.committed == sum(r.committed for r in requests) == 17
    assert batch.rounds == sum(r.rounds for r in requests) == 6
    assert (
        (batch.drafted_rounds, batch.verified_drafts)
        == (4, 14)
        == (
            sum(r.drafted_rounds for r in requests),
            sum(r.verified_drafts for r in requests),
        )
    )
    assert requests[0].accepted == 0 + 1 + 1 and requests[0].bonus == requests[0].committed - 2


def test_decode_stats_merge_and_json_round_trip():
    a = DecodeStats(num_slots=3, requests=1)
    a.record_round([0, 3], [1, 4])
    a.steps, a.generated, a.time_total = 1, 6, 0.5
    b = DecodeStats(num_slots=4, requests=2)
    b.record_round([4], [5])
    b.steps, b.generated, b.time_total = 1, 6, 1.5
    m = a + b
    assert m.num_slots == 4 and m.accept_hist.tolist() == [1, 0, 0, 1, 1]
    assert (m.rounds, m.committed, m.steps, m.generated, m.requests) == (3, 10, 2, 12, 3)
    assert m.tau == pytest.approx(10 / 3) and m.tokens_per_second == pytest.approx(12 / 2.0)
    assert DecodeStats.merged([a, b]).to_dict() == m.to_dict()
    back = DecodeStats.from_dict(json.loads(json.dumps(m.to_dict())))
    assert back.to_dict() == m.to_dict() and torch.equal(back.accept_hist, m.accept_hist)
    old = {k: v for k, v in a.to_dict().items() if k != "requests"}  # files written before `requests` existed
    assert DecodeStats.from_dict(old).requests == 0
    with pytest.raises(KeyError):
        DecodeStats.from_dict({**a.to_dict(), "colour": 1})
