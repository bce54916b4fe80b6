"""Decision-walk vs parallel-passes time per `select` at the CPU default shapes (D 576, V 49,152, H 15,
K 16, d_sel 256, 64-entry history, 1 thread). Residual heads are perturbed so that most slots repair.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_decisions.py
"""

import time

import torch
from drelay_model.selectors.drelay import DRelayConfig, DRelaySelector
from drelay_model.drafter import DraftBlock
from drelay_model.selectors import SelectionContext

torch.manual_seed(0)
torch.set_num_threads(1)
V, D, H, K, Fd = 49152, 576, 15, 16, 3 * 576
res = {}
for dec in ("passes", "walk"):
    torch.manual_seed(0)
    sel = DRelaySelector(DRelayConfig(decisions=dec), embed_weight=torch.randn(V, D), num_slots=H, top_k=K, feature_dim=Fd).eval()
    with torch.no_grad():
        for p in sel.residual_heads():
            p.copy_(torch.randn_like(p) * 0.3)
    for B in (1, 8):
        g = torch.Generator().manual_seed(B)
        lq, ids = torch.log_softmax(torch.randn(B, H, V, generator=g) * 2, -1).topk(K, -1)
        block = DraftBlock(hidden=torch.randn(B, H, D, generator=g), cand_ids=ids, cand_logq=lq)
        ctx = SelectionContext(
            anchor_ids=torch.randint(0, V, (B,), generator=g),
            anchor_pos=torch.zeros(B, dtype=torch.long),
            row_ids=torch.arange(B),
            history=torch.randn(B, 64, Fd, generator=g),
            history_mask=torch.ones(B, 64, dtype=torch.bool),
        )
        for _ in range(5):
            sel.select(block, ctx)
        ts = []
        for _ in range(30):
            t = time.perf_counter()
            p = sel.select(block, ctx)
            ts.append(time.perf_counter() - t)
        ts.sort()
        res[(dec, B)] = (ts[len(ts) // 2] * 1e3, int(p.pool_index.ne(0).sum()))
for k, v in res.items():
    print(k, f"{v[0]:.2f} ms", "repairs", v[1])
