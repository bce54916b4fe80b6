"""The CPU fast path of DRelay's select phase (selectors/drelay/fast.py) decides exactly as the
reference (`select_with_scores(..., reference=True)`): on rounds recorded from real decoding with the
bundled checkpoint, and on rounds of small random selectors whose verified history slides as
decoding slides it (so the history and token caches are exercised)."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest
import torch

from drelay_model.drafter import DraftBlock
from drelay_model.selectors import SelectionContext
from tests.model.test_drelay_selector import D, F_DIM, SMALL, V, make_selector, perturb

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).parent / "fixtures" / "drelay_rounds.pt"
H, K = 6, 5


def assert_same(sel, block, ctx) -> int:
    """Fast and reference traces equal bit for bit; returns the number of repairs."""
    with torch.no_grad():
        ref = sel.select_with_scores(block, ctx, reference=True)
        fast = sel.select_with_scores(block, ctx)
    assert torch.equal(fast.selection.pool_index, ref.selection.pool_index)
    assert torch.equal(fast.selection.path_ids, ref.selection.path_ids)
    assert torch.equal(fast.selection.length, ref.selection.length)
    assert torch.equal(fast.output.gate, ref.output.gate)
    assert torch.equal(fast.output.rank, ref.output.rank)
    return int(ref.selection.pool_index.ne(0).sum())


def sliding_rounds(B: int, seed: int, rounds: int, *, N: int):
    """`rounds` consecutive rounds of B requests: each row's verified features are one sequence and
    its anchor advances 1–3 positions a round (history = the N features before the anchor)."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.randn(B, N + 3 * rounds + 4, F_DIM, generator=g)
    pos = torch.randint(2, N + 2, (B,), generator=g)  # some windows start partly empty
    for _ in range(rounds):
        logq = torch.log_softmax(torch.randn(B, H, V, generator=g) * 2.5, dim=-1)
        cand_logq, cand_ids = logq.topk(K, dim=-1)
        hist = torch.zeros(B, N, F_DIM)
        mask = torch.zeros(B, N, dtype=torch.bool)
        for b, p in enumerate(pos.tolist()):
            n = min(p, N)
            hist[b, N - n :], mask[b, N - n :] = seq[b, p - n : p], True
        block = DraftBlock(hidden=torch.randn(B, H, D, generator=g), cand_ids=cand_ids, cand_logq=cand_logq)
        ctx = SelectionContext(
            anchor_ids=torch.randint(0, V, (B,), generator=g),
            anchor_pos=pos.clone(),
            row_ids=torch.arange(B),
            history=hist,
            history_mask=mask,
        )
        yield block, ctx
        pos = pos + torch.randint(1, 4, (B,), generator=g)


CONFIGS = [
    {},
    {"branches": "shared", "gate_evidence": "slot", "anchor_feature": False},  # the bundled checkpoint's reading
    {"global_read": False},
    {"history_len": 0},
    {"history_len": 0, "anchor_feature": False},
]


@pytest.mark.parametrize("overrides", CONFIGS)
def test_fast_path_equals_reference_over_sliding_rounds(overrides):
    repairs = 0
    for seed, (B, gate_bias) in enumerate([(1, 0.0), (3, 3.0), (4, 8.0)]):
        sel = perturb(make_selector(seed, **overrides), seed, gate_bias=gate_bias)
        for block, ctx in sliding_rounds(B, seed, 5, N=SMALL["history_len"]):
            repairs += assert_same(sel, block, ctx)
            for P in (1, 3):  # cost-aware lengths: the first P decisions only
                assert_same(sel, block, SelectionContext(**{**ctx.__dict__, "max_slots": P}))
    assert repairs > 0


def test_fast_path_survives_reordered_rows_and_weight_updates():
    sel = perturb(make_selector(3), 3, gate_bias=3.0)
    rounds = list(sliding_rounds(4, 7, 3, N=SMALL["history_len"]))
    for block, ctx in rounds:
        assert_same(sel, block, ctx)
    block, ctx = rounds[-1]
    flipped = SelectionContext(**{**ctx.__dict__, "row_ids": ctx.row_ids.flip(0)})  # ids now name other rows
    assert_same(sel, block, flipped)
    with torch.no_grad():
        sel.causal.hist_in.weight.mul_(1.5)  # a training step between rounds: caches must not survive it
        sel.embed_in.weight.add_(0.1)
    assert_same(sel, block, ctx)
    clone = pickle.loads(pickle.dumps(sel))  # copies start with empty caches
    assert_same(clone, block, ctx)
    assert_same(copy.deepcopy(sel), block, ctx)


def test_fast_path_keeps_the_state_dict():
    sel = make_selector(0)
    keys = set(sel.state_dict())
    with torch.inference_mode():
        block, ctx = next(sliding_rounds(1, 0, 1, N=SMALL["history_len"]))
        sel.select(block, ctx)
    assert set(sel.state_dict()) == keys and not any("_fast" in k for k in keys)


def test_fast_path_off_runs_the_reference_with_the_same_decisions():
    """`fast_path = False` (a benchmark's "before"): `select` skips FastSelect's caches altogether
    and decides as the fast path does."""
    sel = perturb(make_selector(2), 2, gate_bias=3.0)
    block, ctx = next(sliding_rounds(3, 2, 1, N=SMALL["history_len"]))
    with torch.inference_mode():
        sel.fast_path = False
        assert not sel.uses_fast_path(block)
        before = sel.select(block, ctx)
        assert sel._fast.tokens._count == 0  # no table filled: the reference ran
        sel.fast_path = True
        assert sel.uses_fast_path(block)
        after = sel.select(block, ctx)
        assert sel._fast.tokens._count > 0
    assert torch.equal(before.path_ids, after.path_ids) and torch.equal(before.pool_index, after.pool_index)


def read_fixture(path: Path) -> list[tuple[DraftBlock, SelectionContext]]:
    """Rounds stored by benchmarks/selector_rounds.py `write_fixture`: one request, consecutive."""
    f = torch.load(path)
    feats, N = f["features"].float(), f["window"]
    out = []
    for i, a in enumerate(f["anchor_pos"].tolist()):
        lo = a - N - f["start"]
        block = DraftBlock(
            hidden=f["hidden"][i : i + 1].float(), cand_ids=f["cand_ids"][i : i + 1], cand_logq=f["cand_logq"][i : i + 1]
        )
        ctx = SelectionContext(
            anchor_ids=f["anchor_ids"][i : i + 1],
            anchor_pos=f["anchor_pos"][i : i + 1],
            row_ids=torch.zeros(1, dtype=torch.long),
            history=feats[None, lo : lo + N],
            history_mask=torch.ones(1, N, dtype=torch.bool),
        )
        out.append((block, ctx))
    return out


RECORDED_WITH = "checkpoints/smollm2-135m@f3a1e833b2"  # the checkpoint the fixture's rounds were decoded with


def _trained_selector(smol, checkpoint: str):
    from drelay_model.drafter import load_drafter
    from drelay_model.selectors import default_registry
    from pipelines.common.checkpoint_refs import resolve_ref

    with torch.no_grad():
        drafter, extra, meta = load_drafter(ROOT / resolve_ref(checkpoint), smol)
        return default_registry().from_checkpoint("drelay", drafter=drafter, tensors=extra, meta=meta).eval()


def test_fast_path_equals_reference_on_recorded_rounds(smol):
    """Rounds recorded from real decoding (the 181-CPU-minute checkpoint, whose head reads the slot
    gate evidence and no anchor feature, on a GSM8K prompt; `bench_selector.py --record … --fixture
    …`), one at a time and as one batch."""
    sel = _trained_selector(smol, RECORDED_WITH)
    rounds = read_fixture(FIXTURE)
    repairs = sum(assert_same(sel, block, ctx) for block, ctx in rounds)
    assert repairs > 0  # the recorded rounds repair: the comparison covers REPAIR decisions
    blocks, ctxs = zip(*rounds)
    batch = DraftBlock(**{k: torch.cat([getattr(b, k) for b in blocks]) for k in ("hidden", "cand_ids", "cand_logq")})
    ctx = SelectionContext(
        **{k: torch.cat([getattr(c, k) for c in ctxs]) for k in ("anchor_ids", "anchor_pos", "history", "history_mask")},
        row_ids=torch.arange(len(ctxs)),
    )
    assert_same(sel, batch, ctx)


def test_fast_path_equals_reference_for_the_bundled_head(smol):
    """The same recorded rounds through the bundled checkpoint's own DRelay head (contrast gate
    evidence, the anchor feature), with at least one repair among them."""
    sel = _trained_selector(smol, "checkpoints/smollm2-135m")
    assert sum(assert_same(sel, block, ctx) for block, ctx in read_fixture(FIXTURE)) > 0
