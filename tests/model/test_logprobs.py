"""Log-probabilities of committed tokens (`decoding/logprobs.py`) equal the target's own: log_softmax of
its full forward over prompt + completion, for AR and speculative decoding (accepted drafts, bonus
tokens, the prefill token), through the continuous batcher with rows asking different k, rows not
asking, and rows joining mid-flight."""

from __future__ import annotations

import pytest
import torch

from drelay_model.decoding import GenerationConfig, SpeculativeEngine
from drelay_model.decoding.batcher import ContinuousBatcher
from drelay_model.decoding.logprobs import committed_tokens, round_logprobs, token_logprobs
from drelay_model.errors import DRelayError

LENGTHS = (5, 9, 3, 7)
BUDGETS = (12, 9, 14, 6)
ASKS = (3, None, 0, 5)  # k alternatives per request; None = not asked
JOINS = {0: [0, 1], 2: [2], 3: [3]}  # step → requests submitted before it


def _reference(target, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """[len(completion), V] the target's log_softmax at each completion token's position, from one
    forward over prompt + completion (no cache, no speculation)."""
    with torch.inference_mode():
        logits = target.hf(torch.tensor([prompt + completion])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : len(prompt) - 1 + len(completion)]


def _run(batcher: ContinuousBatcher, prompts, budgets=BUDGETS, asks=ASKS):
    """Staggered joins; returns per request (streamed tokens, streamed logprobs or None)."""
    tokens: dict[int, list[int]] = {}
    lps: dict[int, list | None] = {}

    def on_update(u):
        assert u.logprobs is None or len(u.logprobs) == len(u.new_tokens)
        tokens.setdefault(u.request_id, []).extend(u.new_tokens)
        if u.logprobs is None:
            lps.setdefault(u.request_id, None)
        else:
            lps.setdefault(u.request_id, []).extend(u.logprobs)

    step = 0
    while step <= max(JOINS) or not batcher.idle:
        for b in JOINS.get(step, []):
            batcher.submit(prompts[b], GenerationConfig(max_new_tokens=budgets[b]), on_update, logprobs=asks[b])
        batcher.step()
        step += 1
    return tokens, lps


def _check(target, prompts, tokens, lps, asks=ASKS):
    for b, p in enumerate(prompts):
        if asks[b] is None:
            assert lps[b] is None, f"request {b} did not ask"
            continue
        ref = _reference(target, p, tokens[b])
        assert [e.token_id for e in lps[b]] == tokens[b]
        got = torch.tensor([e.logprob for e in lps[b]])
        want = ref.gather(1, torch.tensor(tokens[b])[:, None])[:, 0]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        for j, e in enumerate(lps[b]):
            assert len(e.top) == asks[b]
            if not e.top:
                continue
            top_lp = torch.tensor([v for _, v in e.top])
            assert torch.all(top_lp[:-1] >= top_lp[1:]), "top alternatives sorted, most likely first"
            torch.testing.assert_close(top_lp, ref[j].topk(asks[b]).values, atol=1e-4, rtol=0)
            torch.testing.assert_close(ref[j][[i for i, _ in e.top]], top_lp, atol=1e-4, rtol=0)
            assert e.top[0][0] == e.token_id  # greedy: the chosen token is the argmax


@pytest.mark.parametrize("method", ["ar", "native", "drelay"])
def test_batcher_logprobs_equal_the_targets_full_forward(target, make_engine, prompts_of, tiny_selector_config, method):
    prompts = prompts_of(target.vocab_size, LENGTHS)
    engine = make_engine(target, method, config=tiny_selector_config(method))
    tokens, lps = _run(ContinuousBatcher(engine, max_batch=3), prompts)
    _check(target, prompts, tokens, lps)
    for b, p in enumerate(prompts):  # asking changes nothing about the output
        assert tokens[b] == engine.generate([p], GenerationConfig(max_new_tokens=BUDGETS[b])).tokens[0]


@pytest.mark.parametrize("error_rate", [0.0, 0.3])
def test_accepted_drafts_take_the_verify_forwards_logprobs(
    hf_greedy, target, make_engine, prompts_of, scripted_selector, error_rate
):
    """Mostly-right drafts: rounds accept many drafts, so most values come from drafted positions."""
    prompts = prompts_of(target.vocab_size, LENGTHS)
    budgets = (30, 25, 30, 20)
    reference = [p + hf_greedy(target, p, 30) for p in prompts]
    selector = scripted_selector(reference, error_rate=error_rate, vocab=target.vocab_size)
    engine = make_engine(target, "native", selector)
    batcher = ContinuousBatcher(engine, max_batch=4)
    tokens, lps = _run(batcher, prompts, budgets)
    assert batcher.stats.tau > 2  # many accepted drafts per round
    _check(target, prompts, tokens, lps)


def test_round_logprobs_positions_and_rows_not_asking():
    """Hand-built logits: the accepted drafts take positions 0..n−1, the target's token position n."""
    torch.manual_seed(0)
    R, G, V = 3, 4, 11
    logits = torch.randn(R, G + 1, V)
    path = torch.randint(0, V, (R, G))
    accepted, nxt = torch.tensor([0, 2, 4]), torch.tensor([5, 6, 7])
    tokens = committed_tokens(path, accepted, nxt)
    assert tokens[1, :3].tolist() == [*path[1, :2].tolist(), 6] and tokens[2].tolist() == [*path[2].tolist(), 7]
    out = round_logprobs(logits, path, accepted, nxt, [2, None, 0])
    assert out[1] is None and len(out[0]) == 1 and len(out[2]) == 5
    lsm = torch.log_softmax(logits, dim=-1)
    assert out[0][0].token_id == 5 and out[0][0].logprob == pytest.approx(lsm[0, 0, 5].item(), abs=1e-6)
    assert [i for i, _ in out[0][0].top] == lsm[0, 0].topk(2).indices.tolist()
    assert [e.logprob for e in out[2]] == pytest.approx(lsm[2].gather(1, tokens[2][:, None])[:, 0].tolist(), abs=1e-6)
    assert all(e.top == () for e in out[2])
    assert token_logprobs(logits, tokens, accepted + 1, [None] * R) == [None] * R
    assert len(token_logprobs(logits, tokens, accepted + 1, [V + 5, None, None])[0][0].top) == V  # k capped at V


def test_submit_rejects_a_bad_k(target):
    batcher = ContinuousBatcher(SpeculativeEngine(target))
    for bad in (-1, 1.5, True):
        with pytest.raises(DRelayError, match="logprobs"):
            batcher.submit([1, 2], logprobs=bad)


def test_smollm2_with_its_trained_drafter(smol):
    """The CPU default: SmolLM2-135M with the bundled DRelay drafter, whose rounds accept drafts."""
    from pathlib import Path

    from pipelines.common.methods import load_method, resolve_method

    checkpoint = Path(__file__).resolve().parents[2] / "checkpoints" / "smollm2-135m"
    drafter, selector = load_method(resolve_method("drelay", target_spec="smollm2-135m", checkpoint=str(checkpoint)), smol)
    engine = SpeculativeEngine(smol, drafter, selector)
    tok = smol.tokenizer
    prompts = [tok("The first five prime numbers are")["input_ids"], tok("def fibonacci(n):")["input_ids"]]
    batcher = ContinuousBatcher(engine, max_batch=2)
    tokens, lps = _run_pair(batcher, prompts, budgets=(16, 12), asks=(5, 0))
    assert batcher.stats.accept_hist[1:].sum() > 0  # some values come from accepted drafts' positions
    _check(smol, prompts, tokens, lps, asks=(5, 0))


def _run_pair(batcher: ContinuousBatcher, prompts, budgets, asks):
    tokens: dict[int, list[int]] = {}
    lps: dict[int, list] = {}

    def on_update(u):
        tokens.setdefault(u.request_id, []).extend(u.new_tokens)
        lps.setdefault(u.request_id, []).extend(u.logprobs)

    for p, n, k in zip(prompts, budgets, asks):
        batcher.submit(p, GenerationConfig(max_new_tokens=n), on_update, logprobs=k)
    batcher.run()
    return tokens, lps
