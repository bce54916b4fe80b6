"""The engine backend verifies at the cost-aware length by default (the selector's whole path on
request); each finished request's spec
statistics say how many of its rounds drafted and how many drafts they verified (sglext's
`spec_drafted_ct`, `spec_verify_length`)."""

from __future__ import annotations

import asyncio

from deploy.serve.backends.base import GenRequest, SpecStats
from deploy.serve.backends.engine import EngineBackend
from deploy.serve.config import EngineSection, parse_config
from drelay_model.decoding import GenerationConfig


def test_cost_aware_length_reports_its_rounds():
    assert EngineSection().verify_length == "cost"
    cfg = parse_config(
        {"model_id": "t", "engine": {"target": "tiny-llama", "tokenizer": "smollm2-135m", "method": "native",
                                     "random_drafter": True, "max_batch": 2, "verify_length": "cost"}}
    )  # fmt: skip
    backend = EngineBackend(cfg.engine, cfg.limits)
    try:
        assert backend.engine.policy is not None and backend.engine.costs.max_batch >= 2

        async def run():
            return [
                c async for c in backend.submit(GenRequest(prompt_ids=[4, 5, 6], settings=GenerationConfig(max_new_tokens=12)))
            ]

        spec = asyncio.run(run())[-1].spec
    finally:
        backend.shutdown()
    H = backend.engine.num_slots
    assert spec.drafted_ct is not None and 0 <= spec.drafted_ct <= spec.verify_ct
    assert 0 <= spec.verified_drafts <= H * spec.drafted_ct
    assert spec.verify_length == (spec.verified_drafts / spec.drafted_ct if spec.drafted_ct else 0.0)
    assert SpecStats(verify_ct=3).drafted_ct is None  # a backend that does not say (SGLang)
