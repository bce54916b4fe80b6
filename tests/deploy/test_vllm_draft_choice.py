"""The vLLM plugin's parts that need no vLLM (default suite): per-request rings fed as vLLM feeds
them (rows that move between steps, rejected tails, requests leaving and joining, a recomputed
prefill) hold what our engine's history holds; the draft choice's pool is vLLM's argmax at candidate
0; the selector folder's errors are one line; an unknown proposer signature is refused."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from deploy.vllm.draft_choice import DraftChoice, RequestRings, valid_rows
from deploy.vllm.plugin import draft_vocab_logits, register, signature_mismatch
from deploy.vllm.selector_dir import SELECTOR_DIR, native_view, read_selector_dir
from drelay_model.errors import DRelayError
from drelay_model.selectors.native import NativeSelector

N, F = 4, 2


def feats(req: int, positions) -> torch.Tensor:
    """The target feature of request `req` at each position: [req, pos] (rows [T, 2])."""
    return torch.tensor([[float(req), float(p)] for p in positions])


def expected_history(req: int, upto: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The last N features before position `upto` (from `start`), right-aligned, zero-padded."""
    pos = list(range(max(start, upto - N), upto))
    out = torch.zeros(N, F)
    if pos:
        out[N - len(pos) :] = feats(req, pos)
    return out, torch.arange(N) >= N - len(pos)


def step(rings, batch, known):
    """One vLLM step. batch: [(req id, req index, first position, rows computed, rejected)]."""
    hidden = torch.cat([feats(i, range(p, p + n)) for _, i, p, n, _ in batch])
    lens = torch.tensor([n for *_, n, _ in batch])
    qsl = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    rejected = torch.tensor([r for *_, r in batch])
    rows = rings.rows_for([b[0] for b in batch], known)
    first = torch.tensor([p for _, _, p, _, _ in batch])
    rings.append_step(rows, hidden, qsl, rejected, first, width=min(N, int(lens.max())))
    return rows


def check(rings, rows, expectations):
    h, m = rings.read(rows)
    for b, (req, upto, start) in enumerate(expectations):
        want_h, want_m = expected_history(req, upto, start)
        assert torch.equal(m[b], want_m) and torch.equal(h[b], want_h), (b, h[b], want_h)


def test_rings_follow_requests_across_moving_rows():
    rings = RequestRings(3, N, F)
    # prefill: a (6 prompt tokens) and b (3)
    rows = step(rings, [("a", 0, 0, 6, 0), ("b", 1, 0, 3, 0)], {"a", "b"})
    check(rings, rows, [(0, 6, 0), (1, 3, 0)])
    # verify 1 + 3 drafts each, rows swapped; b rejects 2 drafts, a accepts all
    rows = step(rings, [("b", 1, 3, 4, 2), ("a", 0, 6, 4, 0)], {"a", "b"})
    check(rings, rows, [(1, 5, 0), (0, 10, 0)])
    # a finished (vLLM forgot it); c joins with a prefill of 2 and takes a free row
    rows = step(rings, [("c", 2, 0, 2, 0), ("b", 1, 5, 4, 3)], {"b", "c"})
    check(rings, rows, [(2, 2, 0), (1, 6, 0)])
    assert set(rings.rows) == {"b", "c"}
    # b preempted and recomputed from position 0: its ring restarts; d fills the third row
    rows = step(rings, [("b", 1, 0, 8, 0), ("d", 3, 0, 1, 0), ("c", 2, 2, 4, 1)], {"b", "c", "d"})
    check(rings, rows, [(1, 8, 0), (3, 1, 0), (2, 5, 0)])
    # a fourth live request with every row taken evicts one absent from the batch, which restarts
    rows = step(rings, [("e", 4, 0, 3, 0)], {"b", "c", "d", "e"})
    check(rings, rows, [(4, 3, 0)])
    # a prefix-cache hit: the history starts at the first uncached position
    rows = step(rings, [("f", 5, 7, 2, 0), ("e", 4, 3, 4, 0)], {"f", "e"})
    check(rings, rows, [(5, 9, 7), (4, 7, 0)])


def test_valid_rows_takes_the_last_rows_before_the_rejected_tail():
    hidden = torch.arange(10.0)[:, None]
    got, n_new, end = valid_rows(hidden, torch.tensor([0, 6, 10]), torch.tensor([1, 2]), 3)
    assert n_new.tolist() == [3, 2] and end.tolist() == [5, 8]
    assert got[0, :, 0].tolist() == [2.0, 3.0, 4.0] and got[1, :2, 0].tolist() == [6.0, 7.0]


def stage_three_requests(choice: DraftChoice) -> DraftChoice:
    """One vLLM step of requests x, y, z (two verified rows each) staged on `choice`."""
    choice.stage(["x", "y", "z"], {"x", "y", "z"}, hidden=torch.randn(6, 2), qsl=torch.tensor([0, 2, 4, 6]), rejected=None,
                 positions=torch.arange(6), anchors=torch.tensor([1, 2, 3]), max_query_len=2)  # fmt: skip
    return choice


def two_steps_swapping_rows(choice: DraftChoice, D: int):
    """Two vLLM steps of requests a (2 rows) and b (3 rows), the second with their batch rows
    swapped; yields each step's batch order once the choice has chosen its drafts."""
    head = torch.randn(10, D)
    lens = {"a": 2, "b": 3}
    for order in (["a", "b"], ["b", "a"]):
        hidden = torch.cat([feats(ord(r), range(lens[r])) for r in order])
        qsl = torch.tensor([0, lens[order[0]], lens[order[0]] + lens[order[1]]])
        choice.stage(order, {"a", "b"}, hidden=hidden, qsl=qsl, rejected=None, positions=torch.cat([torch.arange(lens[r]) for r in order]),
                     anchors=torch.tensor([1, 2]), max_query_len=3)  # fmt: skip
        choice.choose(lambda h: h @ head.T, torch.randn(2 * choice.num_slots, D))
        yield order


class _SeesContext(NativeSelector):
    """The native choice, remembering the block and context it was given (what the selector is handed)."""

    def select(self, block, ctx):
        self.block, self.ctx = block, ctx
        return super().select(block, ctx)


def test_native_choice_is_vllms_argmax():
    torch.manual_seed(0)
    B, H, K, D, V = 3, 4, 5, 8, 50
    head = torch.randn(V, D)
    choice = stage_three_requests(DraftChoice(NativeSelector(), num_slots=H, top_k=K, rings=None))
    hidden = torch.randn(B * H, D)
    ids = choice.choose(lambda h: h @ head.T, hidden)
    assert torch.equal(ids, (hidden @ head.T).argmax(-1)) and choice.staged is None


class _DraftVocabHead(torch.nn.Module):
    """The code around `draft_vocab_logits`: a draft model shaped as vLLM's DFlash drafters are
    (`lm_head` over V_d draft ids, `draft_id_to_target_id` offsets, `logits_processor(lm_head, h)`),
    whose `compute_logits` scatters the head into the target vocabulary with −inf elsewhere, as
    vLLM 0.32's `Qwen3DFlashForCausalLM.compute_logits` does — or, `scale` ≠ 1, does something else."""

    def __init__(self, target_ids: torch.Tensor, V: int, D: int, scale: float = 1.0) -> None:
        super().__init__()
        self.lm_head = torch.nn.Linear(D, target_ids.shape[0], bias=False)
        self.draft_id_to_target_id = target_ids - torch.arange(target_ids.shape[0])
        self.V, self.scale = V, scale

    def logits_processor(self, head, hidden):
        return head(hidden)

    def compute_logits(self, hidden):
        full = hidden.new_full((hidden.shape[0], self.V), float("-inf"))
        full[:, torch.arange(self.lm_head.out_features) + self.draft_id_to_target_id] = (
            self.logits_processor(self.lm_head, hidden) * self.scale
        )
        return full


def test_the_pool_over_the_draft_vocabulary_is_the_pool_over_the_target_vocabulary():
    """Pooling over the draft vocabulary's columns and mapping the ids gives the candidates and the
    log-probabilities of the pool over vLLM's scattered target-vocabulary logits, and the native
    choice is vLLM's argmax; a compute_logits that is not the scattered head keeps the full path."""
    torch.manual_seed(0)
    B, H, K, D, V = 3, 4, 5, 8, 60
    target_ids = torch.randperm(V)[:20].sort().values  # [V_d] sorted target ids
    model = _DraftVocabHead(target_ids, V, D)
    logits_fn, ids = draft_vocab_logits(model)
    assert torch.equal(ids, target_ids)
    hidden = torch.randn(B * H, D)
    seen, picks = {}, {}
    for tag, args in (("draft", (logits_fn, hidden, ids)), ("full", (model.compute_logits, hidden))):
        seen[tag] = _SeesContext()
        picks[tag] = stage_three_requests(DraftChoice(seen[tag], num_slots=H, top_k=K, rings=None)).choose(*args)
    assert torch.equal(seen["draft"].block.cand_ids, seen["full"].block.cand_ids)
    torch.testing.assert_close(seen["draft"].block.cand_logq, seen["full"].block.cand_logq)
    assert torch.equal(picks["draft"], model.compute_logits(hidden).argmax(-1)) and torch.equal(picks["draft"], picks["full"])
    for other in (_DraftVocabHead(target_ids, V, D, scale=2.0), torch.nn.Module()):
        other.compute_logits = getattr(other, "compute_logits", lambda h: h)
        fn, none = draft_vocab_logits(other)
        assert none is None and fn == other.compute_logits


def test_the_choice_names_requests_by_their_ring_rows_wherever_vllm_moves_them():
    """The selector's row ids are the requests' ring rows, not batch positions: the fast path's
    history cache (keyed by row id) then follows a request across vLLM's row moves."""
    H, K, D = 2, 3, 4
    sel = _SeesContext()
    choice = DraftChoice(sel, num_slots=H, top_k=K, rings=RequestRings(3, N, F))
    choice.profiler = (profiled := []).append
    ids_of = {}
    for order in two_steps_swapping_rows(choice, D):
        for b, r in enumerate(order):
            ids_of.setdefault(r, set()).add(int(sel.ctx.row_ids[b]))
    assert all(len(v) == 1 for v in ids_of.values()) and ids_of["a"] != ids_of["b"]
    assert [p["batch"] for p in profiled] == [2, 2]  # the profiler: one record per step, every part timed
    assert all(
        set(p) == {"batch", "stage_ms", "logits_ms", "pool_ms", "history_ms", "select_ms"} and min(p.values()) >= 0
        for p in profiled
    )


def test_recorded_steps_read_back_as_the_context_the_selector_saw(tmp_path):
    """The plugin's recorder (DRELAY_VLLM_RECORD) and the profile script's reader agree: each
    recorded step comes back as the block and context the selector was handed."""
    import sys
    from pathlib import Path

    from deploy.vllm.plugin import _recorder

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from profile_vllm_plugin import recorded_inputs

    H, K, D = 2, 3, 4
    sel = _SeesContext()
    choice = DraftChoice(sel, num_slots=H, top_k=K, rings=RequestRings(3, N, F))
    choice.recorder = _recorder(str(tmp_path))
    seen = [sel.ctx for _ in two_steps_swapping_rows(choice, D)]
    read = recorded_inputs(tmp_path, 2, limit=8)
    assert len(read) == 2
    for (block, ctx), want in zip(read, seen):
        for k in ("anchor_ids", "anchor_pos", "row_ids", "history", "history_mask"):
            assert torch.equal(getattr(ctx, k), getattr(want, k)), k
        assert block.cand_ids.shape == (2, H, K)


def test_selector_folder_errors_are_one_line(tmp_path):
    draft = tmp_path / "draft"
    draft.mkdir()
    assert read_selector_dir(draft) is None
    (draft / SELECTOR_DIR).mkdir()
    (draft / SELECTOR_DIR / "config.json").write_text(json.dumps({"selector": {"name": "drelay"}}))
    with pytest.raises(DRelayError) as err:
        read_selector_dir(draft)
    assert "drelay_selector/config.json" in str(err.value) and "\n" not in str(err.value)
    (draft / "model.safetensors").write_text("x")
    view = native_view(draft, tmp_path / "native")
    assert [p.name for p in view.iterdir()] == ["model.safetensors"] and read_selector_dir(view) is None


def test_unknown_proposer_signature_is_refused(caplog):
    class Proposer:
        def __init__(self, vllm_config, device, runner=None): ...
        def load_model(self, target_model): ...
        def propose(
            self, target_positions, target_hidden_states, next_token_ids, common_attn_metadata, num_rejected_tokens_gpu
        ): ...
        def _sample_draft_tokens(self, hidden_states, sampling_metadata): ...

    assert signature_mismatch(Proposer) is None
    Proposer.propose = lambda self, target_hidden_states, next_token_ids: None
    assert "propose has no parameter target_positions" in signature_mismatch(Proposer)
    with caplog.at_level(logging.WARNING):
        register()  # no vLLM in this venv: one warning, nothing wrapped, no exception
    assert "drafting stays native" in caplog.text
