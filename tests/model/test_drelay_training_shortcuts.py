"""DRelay's training-time shortcuts compute exactly what the plain forms compute."""

from __future__ import annotations

import torch

from drelay_model.selectors.drelay import DRelayConfig, DRelaySelector

V, D, H, K = 97, 24, 6, 5


def test_embedding_projection_of_distinct_ids_equals_the_dense_one(monkeypatch):
    """Under autograd `embed` projects each distinct id once: same values and same W_e gradient."""
    from drelay_model.selectors.drelay import selector as selector_module

    torch.manual_seed(3)
    sel = DRelaySelector(
        DRelayConfig(d_sel=32, heads=4, read_dim=16, history_len=8, compact_dim=16, ffn_mult=2),
        embed_weight=torch.randn(V, D),
        num_slots=H,
        top_k=K,
        feature_dim=48,
    )
    ids = torch.randint(0, V, (4, H, K), generator=torch.Generator().manual_seed(0))  # 120 ids, ≤ 97 distinct
    out = {}
    for name, threshold in (("dense", 10**9), ("distinct", 0)):
        monkeypatch.setattr(selector_module, "_DEDUP_MIN_IDS", threshold)
        sel.zero_grad()
        emb = sel.embed(ids)
        (emb * torch.linspace(-1, 1, emb.shape[-1])).sum().backward()
        out[name] = (emb.detach(), sel.embed_in.weight.grad.clone())
    torch.testing.assert_close(out["distinct"][0], out["dense"][0])
    torch.testing.assert_close(out["distinct"][1], out["dense"][1], rtol=1e-5, atol=1e-5)
