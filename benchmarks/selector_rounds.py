"""DRelay select rounds recorded from real decoding, and the select phase's cost by part.

    record_rounds   our engine decodes GSM8K prompts with the bundled checkpoint at batch 1 (fixed
                    verification length); every `select` call's inputs (block, anchors, positions,
                    row ids, verified history) are kept, in the order decoding made them
    write_fixture   a few consecutive rounds of one request, compact (bf16 features and hidden
                    states, the history as one feature sequence): tests/model/fixtures/
    batches         B rows per round from consecutive recorded rounds (rows are independent)
    time_parts      the select phase split into the parts named in `PARTS`, reference and fast path
                    alternating per repetition (thread CPU time, medians)

Used by benchmarks/bench_selector.py (`--record`, `--parts`) and tests/model/test_drelay_fast.py.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from drelay_model.drafter.model import DraftBlock
from drelay_model.selectors.base import SelectionContext

KEYS = ("hidden", "cand_ids", "cand_logq", "anchor_ids", "anchor_pos", "row_ids", "history", "history_mask")


def record_rounds(target, checkpoint: str, prompts: list[list[int]], max_new_tokens: int) -> list[dict]:
    """Decode `prompts` one at a time with DRelay over `checkpoint`; one dict of KEYS per round."""
    from deploy.vllm.peer import our_engine
    from drelay_model.decoding import GenerationConfig

    engine = our_engine(target, "drelay", checkpoint)
    selector, rounds = engine.selector, []
    select = selector.select

    def recording(block: DraftBlock, ctx: SelectionContext):
        rounds.append({k: getattr(block if k in ("hidden", "cand_ids", "cand_logq") else ctx, k).clone() for k in KEYS})
        return select(block, ctx)

    selector.select = recording
    for p in prompts:
        engine.generate([p], GenerationConfig(max_new_tokens=max_new_tokens))
    selector.select = select
    return rounds


def write_fixture(rounds: list[dict], path: Path, *, count: int) -> None:
    """`count` consecutive rounds of the first request with a full history window, compact: features
    as one sequence (bf16), hidden states bf16; `read_fixture` rebuilds the rounds."""
    first = next(i for i, r in enumerate(rounds) if bool(r["history_mask"].all()))
    chosen = rounds[first : first + count]
    assert all(int(r["row_ids"][0]) == int(chosen[0]["row_ids"][0]) for r in chosen), "rounds of one request"
    N = chosen[0]["history"].shape[1]
    start = int(chosen[0]["anchor_pos"][0]) - N  # absolute position of the first feature stored
    end = int(chosen[-1]["anchor_pos"][0])
    seq = torch.zeros(end - start, chosen[0]["history"].shape[2])
    for r in chosen:
        a = int(r["anchor_pos"][0])
        seq[a - N - start : a - start] = r["history"][0]
    torch.save(
        {
            "features": seq.to(torch.bfloat16),
            "start": start,
            "window": N,
            "hidden": torch.cat([r["hidden"] for r in chosen]).to(torch.bfloat16),
            **{k: torch.cat([r[k] for r in chosen]) for k in ("cand_ids", "cand_logq", "anchor_ids", "anchor_pos")},
        },
        path,
    )


def read_fixture(path: Path) -> list[dict]:
    """The rounds `write_fixture` stored, as float32 rounds of one row each (KEYS)."""
    f = torch.load(path)
    feats, N = f["features"].float(), f["window"]
    out = []
    for i, a in enumerate(f["anchor_pos"].tolist()):
        lo = a - N - f["start"]
        out.append(
            {
                "hidden": f["hidden"][i : i + 1].float(),
                "cand_ids": f["cand_ids"][i : i + 1],
                "cand_logq": f["cand_logq"][i : i + 1],
                "anchor_ids": f["anchor_ids"][i : i + 1],
                "anchor_pos": f["anchor_pos"][i : i + 1],
                "row_ids": torch.zeros(1, dtype=torch.long),
                "history": feats[None, lo : lo + N],
                "history_mask": torch.ones(1, N, dtype=torch.bool),
            }
        )
    return out


def as_inputs(rows: list[dict], row_ids: list[int] | None = None) -> tuple[DraftBlock, SelectionContext]:
    """One batch from recorded rounds (row b = rows[b]; its request id row_ids[b], default b)."""
    cat = lambda k: torch.cat([r[k] for r in rows])  # noqa: E731
    block = DraftBlock(hidden=cat("hidden"), cand_ids=cat("cand_ids"), cand_logq=cat("cand_logq"))
    ids = torch.tensor(row_ids if row_ids is not None else list(range(len(rows))))
    ctx = SelectionContext(
        anchor_ids=cat("anchor_ids"),
        anchor_pos=cat("anchor_pos"),
        row_ids=ids,
        history=cat("history"),
        history_mask=cat("history_mask"),
    )
    return block, ctx


def batches(rounds: list[dict], batch: int) -> list[tuple[DraftBlock, SelectionContext]]:
    """Consecutive batches: step t holds round t of `batch` request streams (stream b reads the
    recorded rounds from offset b·len/batch on, each stream as one row id), so the rows slide as
    real decoding slides them."""
    span = len(rounds) // batch
    return [as_inputs([rounds[b * span + t] for b in range(batch)]) for t in range(span)]


PARTS = (
    "slot features",
    "pool embedding gathers",
    "Global Read",
    "verified-history projection",
    "candidate states + history read",
    "walk inputs",
    "walk step (mean of H)",
    "select (whole)",
)


def _timed(fn, *args):
    t0 = time.thread_time()
    out = fn(*args)
    return out, (time.thread_time() - t0) * 1e3


def time_parts(sel, inputs: list, *, reps: int) -> dict[str, dict[str, float]]:
    """Median thread-CPU ms of each part in PARTS, {path: {part: ms}} for path in (reference, fast),
    the two paths alternating per batch. The parts are the reference's own functions; the fast
    path's are timed by running `FastSelect` with one part at a time switched to its reference."""
    import torch.nn.functional as F

    from drelay_model.selectors.drelay.walk import walk, walk_inputs

    t: dict[str, dict[str, list]] = {"reference": {p: [] for p in PARTS}, "fast": {p: [] for p in PARTS}}
    cr, gr = sel.causal, sel.global_read
    with torch.inference_mode():
        for rep in range(reps + 2):
            for block, ctx in inputs:
                H = block.cand_ids.shape[1]
                for path in ("reference", "fast"):
                    _, ms = _timed(lambda: sel.select_with_scores(block, ctx, reference=path == "reference"))
                    if rep >= 2:
                        t[path]["select (whole)"].append(ms)
                if rep < 2:
                    continue
                ref = t["reference"]
                s, ms = _timed(lambda: sel.slot_norm(sel.slot_in(block.hidden)) + sel.slot_pos[:H])
                ref["slot features"].append(ms)
                emb, ms = _timed(lambda: sel.embed_in(F.embedding(block.cand_ids, sel.embed_weight)))
                ref["pool embedding gathers"].append(ms)
                g, ms = _timed(gr, s, emb, block.cand_logq) if gr is not None else ((None, 0.0))
                ref["Global Read"].append(ms)
                _, ms = _timed(lambda: cr.hist_norm(cr.hist_in(ctx.history[:, -max(cr.history_len, 1) :])))
                ref["verified-history projection"].append(ms)
                ev, ms = _timed(cr.evidence, s, g.z, g.c, emb, block.cand_logq, ctx.history, ctx.history_mask)
                ref["candidate states + history read"].append(ms - ref["verified-history projection"][-1])
                w, ms = _timed(walk_inputs, cr, ev, sel.embed(ctx.anchor_ids), emb)
                ref["walk inputs"].append(ms)
                _, ms = _timed(walk, w)
                ref["walk step (mean of H)"].append(ms / H)
                fast_parts(sel, block, ctx, t["fast"])
    return {path: {p: statistics.median(v) if v else float("nan") for p, v in parts.items()} for path, parts in t.items()}


def fast_parts(sel, block: DraftBlock, ctx: SelectionContext, out: dict[str, list]) -> None:
    """The fast path's parts, in the order `FastSelect.select` runs them."""
    from drelay_model.selectors.drelay import fast

    fs, cr = sel._fast, sel.causal
    H = block.cand_ids.shape[1]
    s, ms = _timed(lambda: sel.slot_norm(sel.slot_in(block.hidden)) + sel.slot_pos[:H])
    out["slot features"].append(ms)
    (emb, n_part, tok), ms = _timed(fs.token_rows, sel, block.cand_ids)
    out["pool embedding gathers"].append(ms)
    (z, c), ms = _timed(fast.global_read, sel.global_read, s, emb, n_part, block.cand_logq)
    out["Global Read"].append(ms)
    projected, ms = _timed(fs.project_history, cr, ctx.history, ctx)
    out["verified-history projection"].append(ms)
    (query, pre), ms = _timed(fs.candidate_states, cr, z, c, block.cand_logq, projected, ctx.history_mask)
    out["candidate states + history read"].append(ms)
    t0 = time.thread_time()
    slot_mem = cr.mem_slot(torch.cat([s, z], dim=-1)) + cr.mem_pos[1 : H + 1]
    anchor = (cr.anchor_flag + cr.mem_pos[0]).expand(block.cand_ids.shape[0], -1)
    _, _, anchor_tok = fs.token_rows(sel, ctx.anchor_ids)
    terms = fast.cr_terms(cr, anchor, anchor_tok), fast.cr_terms(cr, slot_mem[:, :, None], tok)
    out["walk inputs"].append((time.thread_time() - t0) * 1e3)
    logq = block.cand_logq
    _, ms = _timed(
        lambda: fast.lean_walk(
            cr,
            fs.walk_memory(block.cand_ids.shape[0], H, cr, query.shape[-1], query.dtype),
            query=query,
            pre=pre,
            rank0=logq,
            gate0=logq[..., 1:].logsumexp(-1) - logq[..., 0],
            anchor_terms=terms[0],
            cand_terms=terms[1],
        )
    )
    out["walk step (mean of H)"].append(ms / H)
