"""Verified target history: per-row push against brute force, and engine/replay agreement."""

from __future__ import annotations

import torch

from drelay_model.decoding import GenerationConfig, SpeculativeEngine, replay
from drelay_model.decoding.history import VerifiedHistory, history_window
from drelay_model.selectors import NativeSelector, SelectorCapabilities


def test_push_keeps_the_last_n_entries_of_each_row():
    g = torch.Generator().manual_seed(0)
    B, N, F = 3, 5, 2
    hist = VerifiedHistory(B, N, F)
    truth: list[list[torch.Tensor]] = [[] for _ in range(B)]
    for step in range(6):
        T = 4
        new = torch.randn(B, T, F, generator=g)
        n_new = torch.randint(0, T + 1, (B,), generator=g)
        hist.push(new, n_new)
        for b in range(B):
            truth[b] += [new[b, i] for i in range(int(n_new[b]))]
        mask = hist.mask()
        for b in range(B):
            expect = truth[b][-N:]
            assert int(mask[b].sum()) == len(expect)
            if expect:
                torch.testing.assert_close(hist.feats[b, N - len(expect) :], torch.stack(expect))
            assert hist.feats[b, : N - len(expect)].abs().sum() == 0


class HistoryProbe(NativeSelector):
    """Test-only: native choices, recording the history each decision sees."""

    capabilities = SelectorCapabilities(history_len=6)

    def __init__(self):
        super().__init__()
        self.seen = {}

    def select(self, block, ctx):
        for i, (row, pos) in enumerate(zip(ctx.row_ids.tolist(), ctx.anchor_pos.tolist())):
            self.seen[(row, pos)] = (ctx.history[i].clone(), ctx.history_mask[i].clone())
        return super().select(block, ctx)


def test_engine_and_replay_give_selectors_the_same_verified_history(target, make_drafter, prompts_of):
    prompts = prompts_of(target.vocab_size, (3, 9, 5))
    drafter = make_drafter(target, top_k=64)
    live = HistoryProbe()
    result = SpeculativeEngine(target, drafter, live).generate(prompts, GenerationConfig(max_new_tokens=30))
    offline = HistoryProbe()
    replay(target, drafter, prompts, result.tokens, selector=offline)
    assert live.seen.keys() == offline.seen.keys() and live.seen
    for key, (feats, mask) in live.seen.items():
        row, pos = key
        seq = torch.tensor([prompts[row] + result.tokens[row]])
        full = target(seq, target.new_cache(1, seq.shape[1]), feature_layers=drafter.config.target_layer_ids).features
        ref_feats, ref_mask = history_window(full, pos, 6)
        assert torch.equal(mask, ref_mask[0])
        torch.testing.assert_close(feats, ref_feats[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(offline.seen[key][0], feats, atol=1e-4, rtol=1e-4)
