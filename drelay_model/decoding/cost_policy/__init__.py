"""The cost policy: how many drafts a round verifies, from what rounds cost on this machine.

    surface.py   RoundCosts      the measured cost of a round over batch size b, drafted slots h,
                                 decided slots d and verified width t (`RoundCosts.verify`, `.draft_ms`)
    measure.py   measure_costs   times every term of the surface on this machine
    cache.py     cached_costs    the surface cached per machine as JSON (`costs_path` is its key)
    rates.py     SlotRates       running per-slot acceptance rates of one kind of drafted round
    policy.py    CostPolicy      the running decision of one engine or continuous batcher;
                 PolicyRound     a round's one consultation: its plan (`CostPolicy.round`), then the
                                 cut of its drafted paths and what it learns from the round

Verifying fewer drafts never changes what is committed (verification accepts only the target's
own tokens), so every choice the policy makes is lossless. The why and today's figures:
docs/verification-length.md.
"""

from drelay_model.decoding.cost_policy.cache import DEFAULT_MAX_BATCH, MEASURE_BUDGET_S, cached_costs, costs_path
from drelay_model.decoding.cost_policy.measure import isotonic, isotonic_2d, measure_costs
from drelay_model.decoding.cost_policy.policy import CostPolicy, PolicyRound, PolicySettings, RoundTimes, expected_committed
from drelay_model.decoding.cost_policy.rates import SlotRates
from drelay_model.decoding.cost_policy.surface import COSTS_VERSION, RoundCosts, StaleCosts, surface_batches

__all__ = [
    "COSTS_VERSION",
    "DEFAULT_MAX_BATCH",
    "MEASURE_BUDGET_S",
    "CostPolicy",
    "PolicyRound",
    "PolicySettings",
    "RoundCosts",
    "RoundTimes",
    "SlotRates",
    "StaleCosts",
    "cached_costs",
    "costs_path",
    "expected_committed",
    "isotonic",
    "isotonic_2d",
    "measure_costs",
    "surface_batches",
]
