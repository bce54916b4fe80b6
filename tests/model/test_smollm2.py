"""Lossless decoding on the real CPU target, SmolLM2-135M-Instruct (about 30 s: in the default suite,
since losslessness is the first thing it checks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from drelay_model.decoding import GenerationConfig, SpeculativeEngine, replay
from drelay_model.drafter import BlockDrafter, DrafterConfig, load_drafter
from drelay_model.selectors import default_registry

BUNDLED = Path(__file__).resolve().parents[2] / "checkpoints" / "smollm2-135m"

MESSAGES = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did she sell altogether?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Give three tips for staying healthy.",
    "What is the capital of France?",
]
# The bundled drafter's drafts are accepted here (τ ≈ 1.2–1.4 over these first 24 tokens), so each
# method's selection decides what a round commits, and rows in one batch commit different counts.
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


def trained_method(smol, method: str):
    """The bundled drafter with `method`'s selector: DRelay's trained one from the checkpoint, the others
    built fresh on it (seeded)."""
    torch.manual_seed(0)
    drafter, extra, meta = load_drafter(BUNDLED, smol)
    registry = default_registry()
    if method == "drelay":
        return drafter, registry.from_checkpoint(method, drafter=drafter, tensors=extra, meta=meta)
    return drafter, registry.create(method, drafter=drafter)


# One prompt alone, then the other three in one batch: a lone row and a batch whose rows commit
# different counts per round, each against HF's one-prompt-at-a-time greedy output.
BATCHES = ((0, 1), (1, 4))


@pytest.mark.parametrize("method", ["ar", *default_registry().names()])
def test_greedy_equals_huggingface_generate(smol, prompts, hf_reference, method):
    drafter, selector = trained_method(smol, method) if method != "ar" else (None, None)
    engine = SpeculativeEngine(smol, drafter, selector)
    tokens, accepted = [], []
    for start, end in BATCHES:
        result = engine.generate(prompts[start:end], GenerationConfig(max_new_tokens=MAX_NEW))
        tokens += result.tokens
        accepted.append(result.stats.tau)
    assert tokens == hf_reference
    assert method == "ar" or min(accepted) > 1.0, accepted  # drafts were accepted, not only the target's own token


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
