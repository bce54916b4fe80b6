"""The one engine factory: a target, a method spec and a verification length → a decoding engine.

    build_engine(target, spec, verify_length, target_spec=…) → SpeculativeEngine

Every command that decodes (`drelay generate`, `drelay eval`, `drelay compare`, the serve engine
backend, the speed benchmarks) builds its engines here, so the steps target → method → measured
costs → engine and the default verification length are written once.

Verification lengths:
    cost   each round verifies as many drafts as pay off on this machine at the batch's current size
           (0 = an AR round), from the cost surface over batch sizes measured once per machine and
           cached (`drelay_model.decoding.cost_policy`, `drelay costs`)
    fixed  every round verifies the selector's whole path (the paper's setting)
AR decodes the same either way.
"""

from __future__ import annotations

from drelay_model.decoding import SpeculativeEngine
from drelay_model.drafter import BlockDrafter
from drelay_model.errors import DRelayError
from drelay_model.kernels.threads import ThreadPolicy
from drelay_model.selectors import Selector
from drelay_model.target import TargetModel
from drelay_model.decoding.cost_policy import DEFAULT_MAX_BATCH, cached_costs
from pipelines.common.methods import MethodSpec, load_method

VERIFY_LENGTHS = ("cost", "fixed")
DEFAULT_VERIFY_LENGTH = "cost"


def check_verify_length(value: str, where: str = "verify_length") -> str:
    if value not in VERIFY_LENGTHS:
        raise DRelayError(f"{where} must be one of {', '.join(VERIFY_LENGTHS)}, got {value!r}")
    return value


def build_engine(
    target: TargetModel,
    spec: MethodSpec,
    verify_length: str = DEFAULT_VERIFY_LENGTH,
    *,
    target_spec: str,
    method: tuple[BlockDrafter | None, Selector | None] | None = None,
    remeasure: bool = False,
    max_batch: int = DEFAULT_MAX_BATCH,
    threads: ThreadPolicy | None = None,
) -> SpeculativeEngine:
    """The engine that decodes `spec` on `target` with `verify_length`.

    target_spec: the target's spec string (named when the cost curve is measured); method: the spec's
    (drafter, selector) when the caller has loaded them already (None: loaded here); remeasure:
    measure the cost surface again instead of reading the cache; max_batch: the largest batch the
    engine decodes (the surface is measured up to it; larger batches are extrapolated); threads: the
    CPU thread policy its rounds consult (`drelay_model.kernels.threads`; None: torch's count as set)."""
    check_verify_length(verify_length)
    drafter, selector = load_method(spec, target) if method is None else method
    if threads is not None:
        threads.update()  # the costs below are measured on the thread count the rounds will start with
    costs = None
    if verify_length == "cost" and drafter is not None:
        costs = cached_costs(
            target, drafter, selector, target_spec=target_spec, method=spec.name, remeasure=remeasure, max_batch=max_batch
        )
    return SpeculativeEngine(target, drafter, selector, costs=costs, threads=threads)
