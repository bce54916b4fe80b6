"""Step `kernels`: the Triton kernels (drelay_model/kernels/) compiled for the GPU, checked against
their PyTorch references and timed at Qwen3-4B shapes with the paper-sized DRelay selector
(platform/experiments/qwen3-4b/train.yaml: d_sel 768, read_dim 256, 8 heads; H = 15, K = 16,
width 2,560, features from 5 target layers, vocabulary 151,936), bf16, batch 1, 8 and 32.

Per batch: Global Read's candidate attention (Triton vs `GlobalRead.attend` in float32 on the same
bf16-rounded inputs), the decision walk (Triton vs `walk` in float32: identical picks, gate and rank
within bf16 tolerance), and the whole selector with kernels="triton" vs "torch" (identical paths);
median milliseconds of each pair. On CPU (scale tiny) the same code runs under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import copy

import torch

from benchmarks.gpu.common import QWEN3_4B, max_abs_diff, median_ms, paper_setting
from drelay_model.drafter import DraftBlock
from drelay_model.selectors import SelectionContext
from drelay_model.selectors.drelay import DRelayConfig, DRelaySelector

DESCRIPTION = (
    "Triton candidate attention + decision walk vs PyTorch, paper-sized selector, Qwen3-4B shapes, bf16, batch 1/8/32, timed"
)
NEEDS = ("cuda", "triton")
TOL = 2e-2  # bf16 storage of the outputs (the kernels compute in float32)
SHAPES = {
    "full": dict(
        hidden=QWEN3_4B["hidden_size"], features=5, vocab=QWEN3_4B["vocab_size"], H=15, K=16, batches=(1, 8, 32), reps=30
    ),
    "tiny": dict(
        hidden=64,
        features=2,
        vocab=512,
        H=5,
        K=4,
        batches=(1, 2),
        reps=1,
        selector=dict(d_sel=32, read_dim=16, compact_dim=16, heads=2, history_len=8),
    ),
}


def ready() -> str | None:
    """The paper-sized setting this step builds is readable here (pyyaml, the config)."""
    paper_setting()
    return None


def _selectors(s: dict, device: str) -> dict[str, DRelaySelector]:
    """The same random selector with kernels="torch" and "triton"; its zero-initialised residual
    heads are randomised so that REPAIRs happen (a fresh selector always keeps the native path)."""
    config = s.get("selector") or paper_setting()["selector"]
    torch.manual_seed(0)
    embed = torch.randn(s["vocab"], s["hidden"]) * 0.02
    out = {}
    for backend in ("torch", "triton"):
        sel = DRelaySelector(
            DRelayConfig.from_dict({**config, "kernels": backend}),
            embed_weight=embed,
            num_slots=s["H"],
            top_k=s["K"],
            feature_dim=s["features"] * s["hidden"],
        )
        if backend == "torch":
            with torch.no_grad():
                for p in sel.residual_heads():
                    p.copy_(torch.randn_like(p))
        else:
            sel.load_state_dict(out["torch"].state_dict())
        out[backend] = sel.to(device, torch.bfloat16).eval()
    return out


def _inputs(s: dict, B: int, device: str, history_len: int) -> tuple[DraftBlock, SelectionContext]:
    g = torch.Generator(device=device).manual_seed(B)
    H, K, D, F = s["H"], s["K"], s["hidden"], s["features"] * s["hidden"]
    logq = torch.log_softmax(torch.randn(B, H, s["vocab"], device=device, generator=g) * 2, -1)
    cand_logq, cand_ids = logq.topk(K, dim=-1)
    block = DraftBlock(hidden=torch.randn(B, H, D, device=device, generator=g).bfloat16(), cand_ids=cand_ids, cand_logq=cand_logq)
    ctx = SelectionContext(
        anchor_ids=torch.randint(0, s["vocab"], (B,), device=device, generator=g),
        anchor_pos=torch.full((B,), 100, dtype=torch.long, device=device),
        row_ids=torch.arange(B, device=device),
        history=torch.randn(B, history_len, F, device=device, generator=g).bfloat16(),
        history_mask=torch.ones(B, history_len, dtype=torch.bool, device=device),
    )
    return block, ctx


def _attention_check(sel: DRelaySelector, B: int, reps: int, device: str) -> dict:
    from drelay_model.kernels.candidate_read import candidate_attention

    gr = sel.global_read
    H, K, nh = sel.num_slots, sel.top_k, gr.heads
    dg = gr.read_out.in_features // nh
    g = torch.Generator(device=device).manual_seed(7)
    q, k, v = (torch.randn(B, nh, H * K, dg, device=device, generator=g).bfloat16() for _ in range(3))
    logq = torch.log_softmax(torch.randn(B, H, K, device=device, generator=g) * 3, -1).bfloat16()
    mask = torch.rand(B, H, K, device=device, generator=g) > 0.2
    rel = gr.rel_bias.detach()
    with torch.inference_mode():
        ref = copy.deepcopy(gr).float().attend(q.float(), k.float(), v.float(), logq.float(), mask)
        got = candidate_attention(q, k, v, logq, rel, mask)
        err = max_abs_diff(got, ref)
        return {
            "max_abs_err": err,
            "ok": err <= TOL * max(1.0, float(ref.abs().max())),
            "triton_ms": median_ms(lambda: candidate_attention(q, k, v, logq, rel, mask), device, reps=reps, warmup=min(reps, 3)),
            "torch_ms": median_ms(lambda: gr.attend(q, k, v, logq, mask), device, reps=reps, warmup=min(reps, 3)),
        }


def _walk_check(sel: DRelaySelector, block, ctx, reps: int, device: str) -> dict:
    from drelay_model.kernels.walk import walk_triton
    from drelay_model.selectors.drelay.walk import WalkInputs, walk, walk_inputs

    with torch.inference_mode():
        ev, cand_emb = sel.evidence(block, ctx.history, ctx.history_mask)
        w = walk_inputs(sel.causal, ev, sel.embed(ctx.anchor_ids), cand_emb)
        w32 = WalkInputs(**{f: (x.float() if torch.is_tensor(x) and x.is_floating_point() else x) for f, x in vars(w).items()})
        ref, got = walk(w32), walk_triton(w)
        err = max(max_abs_diff(got.gate, ref.gate), max_abs_diff(got.rank, ref.rank))
        same = bool(torch.equal(got.pool_index, ref.pool_index))
        return {
            "same_picks": same,
            "repairs": int(ref.pool_index.ne(0).sum()),
            "max_abs_err": err,
            "ok": same and err <= TOL * max(1.0, float(ref.rank.abs().max())),
            "triton_ms": median_ms(lambda: walk_triton(w), device, reps=reps, warmup=min(reps, 3)),
            "torch_ms": median_ms(lambda: walk(w), device, reps=reps, warmup=min(reps, 3)),
        }


def run(device: str, scale: str) -> dict:
    s = SHAPES[scale]
    sels = _selectors(s, device)
    n = sels["torch"].config.history_len
    report: dict = {
        "shapes": {k: v for k, v in s.items() if k != "reps"},
        "selector_params": sum(p.numel() for p in sels["torch"].parameters()),
        "batches": {},
    }
    ok = True
    for B in s["batches"]:
        block, ctx = _inputs(s, B, device, n)
        with torch.inference_mode():
            a, b = (sels[k].select_with_scores(block, ctx) for k in ("torch", "triton"))
        row = {
            "attention": _attention_check(sels["triton"], B, s["reps"], device),
            "walk": _walk_check(sels["triton"], block, ctx, s["reps"], device),
            "selector": {
                "same_paths": bool(torch.equal(a.selection.path_ids, b.selection.path_ids)),
                "repairs": int(a.selection.pool_index.ne(0).sum()),
                "torch_ms": median_ms(lambda: sels["torch"].select(block, ctx), device, reps=s["reps"], warmup=min(s["reps"], 3)),
                "triton_ms": median_ms(
                    lambda: sels["triton"].select(block, ctx), device, reps=s["reps"], warmup=min(s["reps"], 3)
                ),
            },
        }
        row["selector"]["ok"] = row["selector"]["same_paths"]
        ok &= all(part["ok"] for part in row.values())
        report["batches"][f"B={B}"] = row
    report["ok"] = ok
    return report
