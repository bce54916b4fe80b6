"""Lossless decoding on the real CPU target, SmolLM2-135M-Instruct (slow: ~1 min)."""

from __future__ import annotations

import pytest
import torch

from drelay_model.decoding import GenerationConfig, SpeculativeEngine, replay
from drelay_model.drafter import BlockDrafter, DrafterConfig
from drelay_model.selectors import default_registry

pytestmark = pytest.mark.slow

MESSAGES = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did she sell altogether?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Give three tips for staying healthy.",
    "What is the capital of France?",
]
# An untrained drafter's paths are rejected (τ ≈ 1): each new token costs one round (draft, verify the
# whole block on the target, commit the target's own token), and the rounds of a row differ only in
# their position, so the time grows with the tokens while the code paths do not.
MAX_NEW = 24


@pytest.fixture(scope="module")
def prompts(smol):
    tok = smol.tokenizer
    return [
        list(tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True, tokenize=True)["input_ids"])
        for m in MESSAGES
    ]


@pytest.fixture(scope="module")
def hf_reference(smol, prompts):
    out = []
    for p in prompts:
        gen = smol.hf.generate(
            torch.tensor([p]),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            eos_token_id=list(smol.eos_token_ids),
            pad_token_id=smol.eos_token_ids[0],
        )
        out.append(gen[0, len(p) :].tolist())
    return out


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("method", ["ar", *default_registry().names()])
def test_greedy_equals_huggingface_generate(smol, prompts, hf_reference, method, batch):
    drafter = selector = None
    if method != "ar":
        torch.manual_seed(0)
        drafter = BlockDrafter(DrafterConfig.for_target(smol), smol)
        selector = default_registry().create(method, drafter=drafter)
    engine = SpeculativeEngine(smol, drafter, selector)
    tokens = []
    for i in range(0, len(prompts), batch):
        tokens += engine.generate(prompts[i : i + batch], GenerationConfig(max_new_tokens=MAX_NEW)).tokens
    assert tokens == hf_reference


def test_mostly_right_paths_stay_lossless_and_replay_matches(smol, prompts, hf_reference, scripted_selector):
    torch.manual_seed(0)
    drafter = BlockDrafter(DrafterConfig.for_target(smol), smol)
    reference = [p + r for p, r in zip(prompts, hf_reference)]
    make = lambda: scripted_selector(reference, error_rate=0.15, vocab=smol.vocab_size)  # noqa: E731
    real = SpeculativeEngine(smol, drafter, make()).generate(prompts, GenerationConfig(max_new_tokens=MAX_NEW))
    assert real.tokens == hf_reference
    assert real.stats.tau > 2.0
    replayed = replay(smol, drafter, prompts, hf_reference, selector=make())
    assert replayed.tau == real.stats.tau
