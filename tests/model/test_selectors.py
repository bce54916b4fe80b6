"""Selector registry and the native selector."""

from __future__ import annotations

import pytest
import torch

from drelay_model.drafter import DraftBlock
from drelay_model.errors import DRelayError
from drelay_model.selectors import NativeSelector, SelectionContext, SelectorRegistry, default_registry


def _block(B=2, H=3, K=4):
    ids = torch.arange(B * H * K).view(B, H, K)
    logq = torch.log_softmax(torch.linspace(0, -1, K).expand(B, H, K), dim=-1)
    return DraftBlock(hidden=torch.zeros(B, H, 8), cand_ids=ids, cand_logq=logq)


def _ctx(B=2):
    return SelectionContext(
        anchor_ids=torch.zeros(B, dtype=torch.long), anchor_pos=torch.zeros(B, dtype=torch.long), row_ids=torch.arange(B)
    )


def test_native_keeps_candidate_zero():
    block = _block()
    sel = NativeSelector().select(block, _ctx())
    assert sel.pool_index.eq(0).all()
    assert torch.equal(sel.path_ids, block.cand_ids[..., 0])
    assert sel.length.tolist() == [3, 3]


def test_registry_rejects_duplicates_and_lists_names_for_unknown():
    reg = SelectorRegistry()
    reg.register("native", NativeSelector)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("native", NativeSelector)
    with pytest.raises(DRelayError, match=r"unknown selector 'nope' \(registered: native\)"):
        reg.create("nope")
    with pytest.raises(ValueError):
        reg.register("bad name!", NativeSelector)


def test_default_registry_is_fresh_each_time():
    a = default_registry()
    a.register("extra", NativeSelector)
    assert "extra" not in default_registry()
    assert "native" in default_registry().names()
