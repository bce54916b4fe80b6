"""Step `graphs`: the draft + select path captured in a CUDA graph and replayed, bf16, batch 1, 8
and 32, equal to the same path run eagerly.

The path is one round's proposal at fixed shapes: the drafter's block over the whole static context
cache (the block mask hides entries at or past each row's length, so no length is read on the
host), the pool (LM head, top-K), and the paper-sized DRelay selector (Global Read + the graph-safe
walk). Shapes: the Qwen3-4B drafter (5 layers, width 2,560, 32/8 heads × 128, features from 5
target layers, vocabulary 151,936; a 6-layer random target supplies embedding and head), context
capacity 1,024 with per-row lengths. Each batch: capture once, then for three fresh inputs (copied
into the static buffers) replay and compare candidates, log q, picks and path with an eager run
(bitwise), and with the engine's own `BlockDrafter.draft` + `select` (cropped context; reported).
On CPU (scale tiny) there is no CUDA graph: the path is compiled with `fullgraph=True` instead,
which fails on any host sync, and compared with eager the same way. Timed per batch: the eager round,
its replay, and the two phases alone — `draft_ms` (native's whole proposal) and `select_ms`
(DRelay's select on that block), with `select_per_draft` = select_ms ÷ draft_ms.
"""

from __future__ import annotations

import torch

from benchmarks.gpu.common import QWEN3_4B, QWEN3_TINY, max_abs_diff, median_ms, paper_setting, random_qwen3_target
from drelay_model.drafter import BlockDrafter, DrafterConfig
from drelay_model.selectors import SelectionContext, default_registry

DESCRIPTION = "CUDA-graph capture + replay of draft + select (bf16, batch 1/8/32) equal to eager, timed; select ms ÷ draft ms"
NEEDS = ("cuda",)
SHAPES = {
    "full": dict(
        target=QWEN3_4B, layers=6, features=5, drafter_layers=5, capacity=1024, batches=(1, 8, 32), reps=20, selector=None
    ),
    "tiny": dict(
        target=QWEN3_TINY,
        layers=6,
        features=2,
        drafter_layers=1,
        capacity=48,
        batches=(2,),
        reps=1,
        selector=dict(d_sel=32, read_dim=16, compact_dim=16, heads=2, history_len=8),
    ),
}


def ready() -> str | None:
    """The paper-sized setting this step builds is readable here (pyyaml, the config)."""
    paper_setting()
    return None


def build(s: dict, device: str):
    """(drafter, selector) in bf16 on `device`, random weights; the selector's residual heads are
    randomised so that it repairs (a fresh one keeps the native path)."""
    target = random_qwen3_target(s["target"], layers=s["layers"], device=device, dtype=torch.bfloat16)
    config = DrafterConfig.for_target(target, num_layers=s["drafter_layers"], target_layer_ids=tuple(range(s["features"])))
    torch.manual_seed(1)
    with torch.device(device):
        drafter = BlockDrafter(config, target).to(torch.bfloat16).eval()
        selector = default_registry().create("drelay", drafter=drafter, config=s["selector"] or paper_setting()["selector"])
    with torch.no_grad():
        for p in selector.residual_heads():
            p.copy_(torch.randn_like(p))
    return drafter, selector.to(device, torch.bfloat16).eval()


class StaticRound:
    """Static buffers of one round's inputs and the fixed-shape draft + select over them."""

    def __init__(self, drafter: BlockDrafter, selector, batch: int, capacity: int) -> None:
        self.drafter, self.selector = drafter, selector
        dev = drafter.fc.weight.device
        self.cache = drafter.new_context_cache(batch, capacity)
        n = selector.config.history_len
        F = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
        self.anchor_ids = torch.zeros(batch, dtype=torch.long, device=dev)
        self.history = torch.zeros(batch, n, F, dtype=torch.bfloat16, device=dev)
        self.history_mask = torch.ones(batch, n, dtype=torch.bool, device=dev)
        self.row_ids = torch.arange(batch, device=dev)

    def fill(self, seed: int, vocab: int) -> None:
        """New inputs, written in place: context features for a random length per row."""
        B, cap = self.anchor_ids.shape[0], self.cache.k.shape[3]
        g = torch.Generator(device=self.anchor_ids.device).manual_seed(seed)
        F = self.history.shape[-1]
        lengths = torch.randint(cap // 4, cap - 1, (B,), device=self.anchor_ids.device, generator=g)
        self.cache.crop(torch.zeros_like(lengths))
        self.drafter.extend_context(torch.randn(B, cap - 1, F, device=self.anchor_ids.device, generator=g).bfloat16(), self.cache)
        self.cache.crop(lengths)
        self.anchor_ids.copy_(torch.randint(0, vocab, (B,), device=self.anchor_ids.device, generator=g))
        self.history.copy_(torch.randn(self.history.shape, device=self.anchor_ids.device, generator=g))

    def captured_inputs(self) -> dict[str, torch.Tensor]:
        """Every tensor a captured round reads besides the weights: a replay reads these storages, so
        `fill` (and the cache's `crop` / `extend_context` inside it) must write them in place."""
        ctx = self.context()
        return {
            "anchor_ids": self.anchor_ids,
            "history": self.history,
            "history_mask": self.history_mask,
            "row_ids": self.row_ids,
            "context k": self.cache.k,
            "context v": self.cache.v,
            "context lengths": self.cache.lengths,
            "anchor_pos": ctx.anchor_pos,
        }

    def context(self) -> SelectionContext:
        return SelectionContext(
            anchor_ids=self.anchor_ids,
            anchor_pos=self.cache.lengths,
            row_ids=self.row_ids,
            history=self.history,
            history_mask=self.history_mask,
        )

    def draft(self):
        """The drafted block (the pool) of this round: what native decoding runs before verifying."""
        d = self.drafter
        ctx_kv = [(self.cache.k[i], self.cache.v[i]) for i in range(d.config.num_layers)]  # whole capacity, masked by length
        with torch.inference_mode():
            hidden = d.block_hidden(self.anchor_ids[:, None], self.cache.lengths[:, None], ctx_kv)[:, 0, 1:]
            return d.pool(hidden)

    def select(self, block):
        """DRelay's select phase on a drafted block: what it adds to a native round."""
        with torch.inference_mode():
            return self.selector.select(block, self.context())

    def __call__(self) -> tuple[torch.Tensor, ...]:
        """→ (cand_ids [B, H, K], cand_logq [B, H, K], pool_index [B, H], path_ids [B, H])."""
        block = self.draft()
        sel = self.select(block)
        return block.cand_ids, block.cand_logq, sel.pool_index, sel.path_ids

    def engine_path(self) -> tuple[torch.Tensor, ...]:
        """The engine's own calls on the same inputs (context cropped to the longest row)."""
        block = self.drafter.draft(self.anchor_ids, self.cache)
        sel = self.selector.select(block, self.context())
        return block.cand_ids, block.cand_logq, sel.pool_index, sel.path_ids


def _compare(a: tuple, b: tuple) -> dict:
    names = ("cand_ids", "cand_logq", "pool_index", "path_ids")
    return {
        "bitwise_equal": all(bool(torch.equal(x, y)) for x, y in zip(a, b)),
        "differs": [n for n, x, y in zip(names, a, b) if not torch.equal(x, y)],
        "logq_max_abs_diff": max_abs_diff(a[1], b[1]),
    }


def _capture(fn, device: str):
    """→ (replay callable, its static outputs): a CUDA graph on a GPU, a fullgraph compile on CPU."""
    if torch.device(device).type == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()  # warm-up outside the graph (kernel selection, lazy inits)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = fn()
        return (lambda: graph.replay() or outs), outs
    compiled = torch.compile(fn, fullgraph=True, backend="eager")  # dynamo alone: any host sync is an error
    return compiled, None


def run(device: str, scale: str) -> dict:
    s = SHAPES[scale]
    drafter, selector = build(s, device)
    vocab = drafter.embed_weight.shape[0]
    report: dict = {
        "shapes": {k: v for k, v in s.items() if k not in ("target", "reps")},
        "mode": "cuda graph" if torch.device(device).type == "cuda" else "torch.compile fullgraph (dynamo)",
        "batches": {},
    }
    ok = True
    for B in s["batches"]:
        rnd = StaticRound(drafter, selector, B, s["capacity"])
        rnd.fill(0, vocab)
        replay, _ = _capture(rnd, device)
        captured = {name: t.data_ptr() for name, t in rnd.captured_inputs().items()}
        row = {"inputs": []}
        for seed in (1, 2, 3):
            rnd.fill(seed, vocab)
            moved = [name for name, t in rnd.captured_inputs().items() if t.data_ptr() != captured[name]]
            if moved:  # a replay would read the old storage: a false difference, said as such
                raise RuntimeError(f"captured inputs were reallocated by fill(): {', '.join(moved)}")
            eager = tuple(t.clone() for t in rnd())
            graphed = tuple(t.clone() for t in replay())
            cmp = _compare(graphed, eager)
            cmp["vs_engine_draft"] = _compare(rnd.engine_path(), eager)
            row["inputs"].append(cmp)
            ok &= cmp["bitwise_equal"]
        row["eager_ms"] = median_ms(rnd, device, reps=s["reps"], warmup=min(s["reps"], 3))
        # DRelay's select per round against native's draft per round (eager, the same block each time).
        block = rnd.draft()
        row["draft_ms"] = median_ms(rnd.draft, device, reps=s["reps"], warmup=min(s["reps"], 3))
        row["select_ms"] = median_ms(lambda: rnd.select(block), device, reps=s["reps"], warmup=min(s["reps"], 3))
        row["select_per_draft"] = row["select_ms"] / max(row["draft_ms"], 1e-9)
        row["replay_ms"] = median_ms(replay, device, reps=s["reps"], warmup=min(s["reps"], 3))
        report["batches"][f"B={B}"] = row
    report["ok"] = ok
    return report
