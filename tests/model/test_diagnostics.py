"""Pool diagnostics (DRelay §3, Appendix A): vectorised math against brute force and hand-made rounds."""

from __future__ import annotations

import random

import pytest
import torch

from drelay_model.decoding import GenerationConfig, SpeculativeEngine, replay
from drelay_model.diagnostics import (
    PoolDiagnostics,
    diagnose_rounds,
    first_error,
    one_edit_gain,
    pad_rounds,
    selection_efficiency,
)


def _brute_force(rounds, H: int) -> dict:
    """The definitions, one round at a time, in plain Python."""
    out = dict(complete=0, base_err=0, base_cov=0, srv_err=0, srv_cov=0, gain=0.0)
    for cand, path, ref in rounds:
        cand, path, ref = cand.tolist(), path.tolist(), ref.tolist()
        for key, p in (("base", [c[0] for c in cand]), ("srv", path)):
            A = 0
            while A < min(len(p), len(ref)) and p[A] == ref[A]:
                A += 1
            if A < len(p) and A < len(ref):
                out[f"{key}_err"] += 1
                covered = ref[A] in cand[A]
                out[f"{key}_cov"] += covered
                if key == "srv" and covered and len(ref) == H:
                    R = 0
                    while A + 1 + R < min(len(p), len(ref)) and p[A + 1 + R] == ref[A + 1 + R]:
                        R += 1
                    out["gain"] += 1 + R
        out["complete"] += len(ref) == H
    return out


def _synthetic_rounds(n: int, H: int, K: int, vocab: int, seed: int):
    """Rounds with a small vocabulary (frequent pool hits) and paths/refs of every length."""
    rng = random.Random(seed)
    rounds = []
    for _ in range(n):
        cand = torch.tensor([rng.sample(range(vocab), K) for _ in range(H)])
        ref = torch.tensor([rng.randrange(vocab) for _ in range(rng.choice([H, H, H, rng.randint(1, H)]))])
        # Mostly-right paths: copy ref with random corruptions, sometimes shortened.
        G = rng.choice([H, rng.randint(0, H)])
        path = torch.tensor(
            [r if rng.random() < 0.7 else rng.randrange(vocab) for r in (ref.tolist() + [0] * H)[:G]], dtype=torch.long
        )
        if rng.random() < 0.3:  # make the base path mostly right too
            for i, r in enumerate(ref.tolist()):
                if rng.random() < 0.7:
                    cand[i, 0] = r
        rounds.append((cand, path, ref))
    return rounds


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_vectorised_diagnostics_match_brute_force(seed):
    H, K, vocab = 6, 3, 7
    rounds = _synthetic_rounds(300, H, K, vocab, seed)
    d = diagnose_rounds(*pad_rounds(rounds))
    bf = _brute_force(rounds, H)
    assert d.rounds == 300
    assert (d.complete_blocks, d.base_errors, d.base_covered) == (bf["complete"], bf["base_err"], bf["base_cov"])
    assert (d.served_errors, d.served_covered) == (bf["srv_err"], bf["srv_cov"])
    assert d.one_edit_gain_sum == pytest.approx(bf["gain"])
    assert d.one_edit_gain == pytest.approx(bf["gain"] / bf["complete"])
    assert 0 < d.coverage_first_error < 1 and 0 < d.one_edit_gain


def test_hand_computed_rounds():
    """H = 4, K = 2. Pools list (native, alternative) per slot."""
    t = torch.tensor
    rounds = [
        # error at slot 1, target 7 is the alternative, then slots 2–3 match: gain 1 + 2 = 3
        (t([[1, 9], [5, 7], [3, 0], [4, 0]]), t([1, 5, 3, 4]), t([1, 7, 3, 4])),
        # error at slot 0, target 8 not in the pool: covered = False, gain 0
        (t([[2, 6], [3, 0], [4, 0], [5, 0]]), t([2, 3, 4, 5]), t([8, 3, 4, 5])),
        # no error at all: no error counted, gain 0, but a complete block
        (t([[1, 0], [2, 0], [3, 0], [4, 0]]), t([1, 2, 3, 4]), t([1, 2, 3, 4])),
        # incomplete block (continuation ends after 2 tokens), error at slot 0, covered: counted for
        # coverage, not for the gain average
        (t([[5, 6], [2, 0], [3, 0], [4, 0]]), t([5, 2, 3, 4]), t([6, 2])),
        # served path repaired slot 0 (base wrong, served right), then errs at slot 2 with the target
        # in the pool and slot 3 right: served gain 1 + 1 = 2; base error at 0 is covered
        (t([[5, 6], [2, 0], [3, 9], [4, 0]]), t([6, 2, 3, 4]), t([6, 2, 9, 4])),
    ]
    d = diagnose_rounds(*pad_rounds(rounds))
    assert d == PoolDiagnostics(
        rounds=5, complete_blocks=4, base_errors=4, base_covered=3, served_errors=4, served_covered=3, one_edit_gain_sum=5.0
    )
    assert d.one_edit_gain == pytest.approx(5 / 4)
    assert d.coverage_first_error == pytest.approx(3 / 4)
    gain, complete = one_edit_gain(*pad_rounds(rounds))
    assert gain.tolist() == [3.0, 0.0, 0.0, 2.0, 2.0] and complete.tolist() == [True, True, True, False, True]


def test_short_path_without_mismatch_has_no_error():
    cand, path, ref = pad_rounds([(torch.tensor([[1, 2], [3, 4], [5, 6]]), torch.tensor([1]), torch.tensor([1, 3, 5]))])
    A, has_error = first_error(path, ref)
    assert A.tolist() == [1] and has_error.tolist() == [False]


def test_counts_merge_and_efficiency():
    a = PoolDiagnostics(rounds=2, complete_blocks=2, served_errors=1, served_covered=1, one_edit_gain_sum=3.0)
    b = PoolDiagnostics(rounds=1, complete_blocks=1, served_errors=1, served_covered=0)
    assert (a + b).one_edit_gain == pytest.approx(1.0) and (a + b).coverage_first_error == 0.5
    assert PoolDiagnostics().coverage_first_error == 0.0 and PoolDiagnostics().one_edit_gain == 0.0
    assert selection_efficiency(2.0, 4.0) == 0.5 and selection_efficiency(1.0, 0.0) == 0.0


def test_replay_trace_hook_observes_without_changing_results(target, make_drafter, prompts_of):
    prompts = prompts_of(target.vocab_size, (5, 9))
    drafter = make_drafter(target, top_k=64)
    greedy = SpeculativeEngine(target).generate(prompts, GenerationConfig(max_new_tokens=30)).tokens
    plain = replay(target, drafter, prompts, greedy)
    seen = []
    traced = replay(target, drafter, prompts, greedy, on_round=seen.append)
    assert traced.accept_hist.tolist() == plain.accept_hist.tolist() and traced.committed == plain.committed
    assert len(seen) == traced.rounds and {r.row for r in seen} == {0, 1}
    for r in seen:
        H, K = r.block.cand_ids.shape[1:]
        assert r.path.shape == (H,) and len(r.ref) <= H and r.committed <= r.accepted + 1
        match = (r.path[: len(r.ref)] == r.ref).long().cumprod(0).sum()
        assert int(match) == r.accepted
    oracle_seen = []
    oracle = replay(target, drafter, prompts, greedy, oracle=True, on_round=oracle_seen.append)
    assert len(oracle_seen) == oracle.rounds
    # With the oracle path, every first error is a pool miss.
    d = diagnose_rounds(*pad_rounds([(r.block.cand_ids[0], r.path, r.ref) for r in oracle_seen]))
    assert d.served_covered == 0


# ---- §3.2 continuation evidence -------------------------------------------------------------------
def test_continuation_samples_need_a_covered_error_and_a_correct_suffix():
    from drelay_model.diagnostics import continuation_samples

    H, K = 8, 3
    ref = torch.arange(10, 10 + H)[None].repeat(4, 1)  # [4, H]
    cand = torch.zeros(4, H, K, dtype=torch.long)
    cand[:, :, 0] = ref
    path = ref.clone()
    path[0, 1] = 99
    cand[0, 1, 0] = 99
    cand[0, 1, 2] = ref[0, 1]  # error at 1, covered, suffix 2..5 right  # noqa: E702
    path[1, 1] = 99
    cand[1, 1, 0] = 99  # error at 1, not covered  # noqa: E702
    path[2, 1] = 99
    cand[2, 1, 1] = ref[2, 1]
    path[2, 4] = 98  # covered, but the suffix has an error  # noqa: E702
    path[3, 4] = 99
    cand[3, 4, 1] = ref[3, 4]  # covered error at 4: slots 5..8 would run past H  # noqa: E702
    ok, A = continuation_samples(cand, path, ref, span=4)
    assert ok.tolist() == [True, False, False, False] and A.tolist() == [1, 1, 1, 4]


def test_continuation_scores_equal_one_forward_per_candidate(target):
    from drelay_model.diagnostics import continuation_scores, supported_is_correct

    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, target.vocab_size, (7,), generator=g).tolist()
    cands = torch.randint(0, target.vocab_size, (5,), generator=g)
    suffix = torch.randint(0, target.vocab_size, (4,), generator=g).tolist()
    got = continuation_scores(target, prefix, cands, suffix)
    for k, c in enumerate(cands.tolist()):
        ids = torch.tensor([prefix + [c] + suffix])
        logp = torch.log_softmax(target(ids, target.new_cache(1, ids.shape[1])).logits.float(), -1)[0]
        expect = sum(float(logp[len(prefix) + t, suffix[t]]) for t in range(4))
        assert float(got[k]) == pytest.approx(expect, abs=1e-4)
    best = int(got.argmax())
    assert supported_is_correct(got, cands, int(cands[best])) and not supported_is_correct(got, cands, -1)


def test_real_and_control_suffixes_share_one_prefill(target):
    """§3.2 scores a sample's real suffix and its control from one prefill of the prefix: each row of
    the joint call equals one full forward per (suffix, candidate), and its single-suffix call."""
    from drelay_model.diagnostics import continuation_scores, continuation_scores_per_suffix

    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, target.vocab_size, (9,), generator=g).tolist()
    cands = torch.randint(0, target.vocab_size, (4,), generator=g)
    suffixes = [torch.randint(0, target.vocab_size, (4,), generator=g).tolist() for _ in range(2)]
    got = continuation_scores_per_suffix(target, prefix, cands, suffixes)
    assert got.shape == (2, 4)
    for m, suffix in enumerate(suffixes):
        alone = continuation_scores(target, prefix, cands, suffix)
        assert torch.allclose(got[m], alone, atol=1e-4) and int(got[m].argmax()) == int(alone.argmax())
        for k, c in enumerate(cands.tolist()):
            ids = torch.tensor([prefix + [c] + suffix])
            logp = torch.log_softmax(target(ids, target.new_cache(1, ids.shape[1])).logits.float(), -1)[0]
            expect = sum(float(logp[len(prefix) + t, suffix[t]]) for t in range(4))
            assert float(got[m, k]) == pytest.approx(expect, abs=1e-4)
    with pytest.raises(ValueError, match="one length"):
        continuation_scores_per_suffix(target, prefix, cands, [suffixes[0], suffixes[1][:3]])


def test_the_control_suffix_comes_from_another_prompt():
    """§3.2: "we replace the four subsequent tokens with a suffix from another prompt". Samples from
    prompts [7, 7, 3, 7, 5]: sample 0 skips sample 1 (prompt 7) and takes 2; 1 → 2; 2 → 3; 3 → 4;
    4 → 0 (cyclic). A single prompt has no control."""
    from drelay_model.diagnostics import other_prompt_controls

    prompts = [7, 7, 3, 7, 5]
    controls = other_prompt_controls(prompts)
    assert controls == [2, 2, 3, 4, 0]
    assert all(prompts[c] != prompts[i] for i, c in enumerate(controls))
    assert other_prompt_controls([4, 4, 4]) == [None, None, None] and other_prompt_controls([]) == []
