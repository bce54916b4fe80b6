"""Lossless decoding: speculative output equals the target's own output, for every selector."""

from __future__ import annotations

import math

import pytest
import torch

from drelay_model.decoding import GenerationConfig, RowDraws, SpeculativeEngine
from drelay_model.decoding.sampling import filtered_logits
from drelay_model.errors import DRelayError
from drelay_model.selectors import default_registry
from drelay_model.target import tiny_target

MAX_NEW = 40


@pytest.mark.parametrize("lengths", [(7,), (5, 9, 3, 12)], ids=["batch1", "batch4"])
@pytest.mark.parametrize("method", ["ar", *default_registry().names()])
def test_greedy_output_equals_huggingface_generate(
    hf_greedy, target, make_drafter, prompts_of, tiny_selector_config, method, lengths
):
    prompts = prompts_of(target.vocab_size, lengths)
    if method == "ar":
        engine = SpeculativeEngine(target)
    else:
        drafter = make_drafter(target)
        engine = SpeculativeEngine(
            target, drafter, default_registry().create(method, drafter=drafter, config=tiny_selector_config(method))
        )
    result = engine.generate(prompts, GenerationConfig(max_new_tokens=MAX_NEW))
    for b, p in enumerate(prompts):
        assert result.tokens[b] == hf_greedy(target, p, MAX_NEW), f"row {b} differs from HF generate"


@pytest.mark.parametrize("error_rate", [0.0, 0.1, 0.4])
def test_lossless_when_drafts_are_mostly_right(hf_greedy, target, make_drafter, prompts_of, scripted_selector, error_rate):
    """Paths that match the target for varying lengths exercise every accepted length."""
    prompts = prompts_of(target.vocab_size, (5, 9, 3, 12))
    reference = [p + hf_greedy(target, p, MAX_NEW) for p in prompts]
    selector = scripted_selector(reference, error_rate=error_rate, vocab=target.vocab_size)
    result = SpeculativeEngine(target, make_drafter(target), selector).generate(prompts, GenerationConfig(max_new_tokens=MAX_NEW))
    for b, p in enumerate(prompts):
        assert result.tokens[b] == reference[b][len(p) :]
    stats = result.stats
    assert stats.committed + len(prompts) == sum(len(t) for t in result.tokens)
    if error_rate == 0.0:
        assert stats.tau > 10  # whole blocks accepted: 15 drafts + 1 bonus per round
    else:
        assert 1.0 < stats.tau < 16.0


def test_stops_at_eos_and_budget(hf_greedy, make_drafter, prompts_of, scripted_selector):
    # Pick an EOS id that the tiny target is sure to emit early: its own 3rd greedy token.
    base = tiny_target("tiny-llama")
    prompts = prompts_of(base.vocab_size, (6, 8))
    eos = hf_greedy(base, prompts[0], 5)[2]
    target = tiny_target("tiny-llama", eos=eos)
    reference = [p + hf_greedy(target, p, 30) for p in prompts]
    selector = scripted_selector(reference, error_rate=0.0, vocab=target.vocab_size)
    result = SpeculativeEngine(target, make_drafter(target), selector).generate(prompts, GenerationConfig(max_new_tokens=30))
    assert result.tokens[0][-1] == eos and len(result.tokens[0]) == 3
    for b, p in enumerate(prompts):
        assert result.tokens[b] == reference[b][len(p) :]
        assert len(result.tokens[b]) <= 30


def test_ar_and_speculative_agree_at_the_budget_edge(hf_greedy, target, make_drafter, prompts_of, scripted_selector):
    prompts = prompts_of(target.vocab_size, (4, 4, 4))
    for max_new in (1, 2, 16, 17):
        reference = [p + hf_greedy(target, p, max_new) for p in prompts]
        selector = scripted_selector(reference, error_rate=0.0, vocab=target.vocab_size)
        spec = SpeculativeEngine(target, make_drafter(target), selector).generate(
            prompts, GenerationConfig(max_new_tokens=max_new)
        )
        assert [len(t) for t in spec.tokens] == [max_new] * 3
        assert spec.tokens == [r[4:] for r in reference]


def _exact_joint(target, prompt: list[int], depth: int, cfg: GenerationConfig) -> dict[tuple[int, ...], float]:
    """P(first `depth` sampled tokens) under the target's filtered conditional at cfg's T, by enumeration."""
    probs = {(): 1.0}
    for _ in range(depth):
        prefixes = list(probs)
        seqs = torch.tensor([prompt + list(pre) for pre in prefixes])
        p_next = torch.softmax(filtered_logits(target.hf(seqs).logits[:, -1].double(), cfg), dim=-1)
        probs = {pre + (v,): probs[pre] * p_next[i, v].item() for i, pre in enumerate(prefixes) for v in range(target.vocab_size)}
    return probs


@pytest.mark.parametrize(
    "draft_sampling, filters",
    [(True, {}), (False, {}), (True, {"top_k": 4, "top_p": 0.9})],
    ids=["sampled-path+min(1,p/q)", "argmax-path+match", "sampled-path+top-k+top-p"],
)
def test_sampling_is_lossless_chi_square(make_drafter, draft_sampling, filters):
    """T = 1: the first three tokens of speculative sampling follow the target's exact distribution,
    with the sampled path and the min(1, p/q) rule (pool of 4 of 6 tokens: the residual must also
    cover tokens outside the pool), with the argmax path and the match rule, and with the sampled
    path tested against the top-k / top-p filtered conditional p̃."""
    target = tiny_target("tiny-llama", vocab=6, hidden=32, seed=5)
    prompt, depth, n = [1, 2, 3], 3, 12000
    drafter = make_drafter(target, top_k=4)
    cfg = GenerationConfig(max_new_tokens=depth, temperature=1.0, seed=7, draft_sampling=draft_sampling, **filters)
    result = SpeculativeEngine(target, drafter).generate([prompt] * n, cfg)
    assert result.stats.accept_hist[1:].sum() > 0.05 * result.stats.rounds  # drafts do get accepted
    exact = _exact_joint(target, prompt, depth, cfg)
    counts: dict[tuple[int, ...], int] = {}
    for toks in result.tokens:
        counts[tuple(toks)] = counts.get(tuple(toks), 0) + 1
    # Pearson's chi-square over cells with expected count ≥ 5 (the rest pooled into one cell).
    stat, df, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for cell, p in exact.items():
        e, o = n * p, counts.get(cell, 0)
        if e >= 5:
            stat += (o - e) ** 2 / e
            df += 1
        else:
            pooled_obs, pooled_exp = pooled_obs + o, pooled_exp + e
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        df += 1
    z = 3.29  # one-sided p = 0.0005; Wilson–Hilferty approximation of the chi-square quantile
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    assert stat < critical, f"chi2={stat:.1f} ≥ {critical:.1f} (df={df})"


def test_sampled_rule_accepts_with_the_overlap_of_p_and_q():
    """One slot, p and q fixed: P(accept) = Σ_v min(p(v), q(v)), and the committed token ~ p."""
    from drelay_model.decoding.verify import accept_sampled

    g = torch.Generator().manual_seed(0)
    V, K, n = 5, 3, 40000
    logits = torch.randn(1, 2, V, generator=g).expand(n, 2, V).contiguous()
    p = torch.softmax(logits[0, 0], -1)
    ids = torch.tensor([4, 0, 2]).expand(n, 1, K).contiguous()
    q_pool = torch.tensor([0.6, 0.3, 0.1])
    path = ids[:, 0].gather(1, torch.multinomial(q_pool, n, replacement=True, generator=g)[:, None])  # [n, 1] drawn from q
    draws = [RowDraws(seed) for seed in range(n)]
    acc, nxt = accept_sampled(
        path, logits, torch.ones(n, dtype=torch.long), ids, q_pool.expand(n, 1, K), temperature=1.0, draws=draws
    )
    q = torch.zeros(V).index_add_(0, ids[0, 0], q_pool)
    overlap = torch.minimum(p, q).sum()
    assert acc.float().mean().item() == pytest.approx(overlap.item(), abs=0.01)
    first = torch.where(acc == 1, path[:, 0], nxt)  # the committed first token
    freq = torch.bincount(first, minlength=V).float() / n
    torch.testing.assert_close(freq, p, atol=0.01, rtol=0)


def test_sampling_is_seeded(target, make_drafter, prompts_of):
    prompts = prompts_of(target.vocab_size, (5, 6))
    cfg = GenerationConfig(max_new_tokens=12, temperature=0.8, seed=3)
    engine = SpeculativeEngine(target, make_drafter(target))
    assert engine.generate(prompts, cfg).tokens == engine.generate(prompts, cfg).tokens


@pytest.mark.parametrize(
    "prompts, kwargs, message",
    [
        ([], {}, "no prompts"),
        ([[]], {}, "prompt 0 is empty"),
        ([[1] * 2000], {}, "prompt 0 has 2000 tokens"),
        ([[999999]], {}, "token ids outside"),
        ([[1]], {"max_new_tokens": 0}, "max_new_tokens must be"),
        ([[1]], {"temperature": -1.0}, "temperature must be"),
    ],
)
def test_bad_requests_are_clear_errors(target, prompts, kwargs, message):
    with pytest.raises(DRelayError, match=message):
        SpeculativeEngine(target).generate(prompts, GenerationConfig(**kwargs))
