"""`drelay export --format vllm`: on the exported weights, vLLM's DFlash order of operations (one
`hidden_norm` on the projected context, no input norm on it, `input_layernorm` on the block, the
mask embedding substituted at `mask_token_id`, `d2t` offsets) gives our `BlockDrafter`'s hidden
states and draft ids; bad input is one line, exit 2, nothing written.

`VllmOrderDrafter` is written from reading vLLM 0.32's `model_executor/models/qwen3_dflash.py`
(what its layers compute, in which order), as plain torch: it reads only the exported directory
and the target's embedding/head, never our drafter.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from deploy.vllm.export import ARCHITECTURE, CONFIG, MASK_FILE, NOTE, WEIGHTS
from deploy.vllm.selector_dir import read_selector_dir
from drelay_model.drafter import BlockDrafter, DrafterConfig, load_drafter, save_drafter
from drelay_model.target import load_target
from cli.main import main as drelay
from pipelines.common.paths import BUNDLED_CHECKPOINTS

TINY = "tiny-qwen3:vocab=384,seed=1"


class VllmOrderDrafter:
    """vLLM's DFlash draft forward on an exported directory, one row, one block."""

    def __init__(self, out: Path, target) -> None:
        from safetensors.torch import load_file

        self.cfg = json.loads((out / CONFIG).read_text())
        self.w = load_file(str(out / WEIGHTS))
        mask = torch.load(out / MASK_FILE, weights_only=True)
        assert mask["mask_token_id"] == self.cfg["dflash_config"]["mask_token_id"]
        self.mask_id, self.mask_vec = mask["mask_token_id"], mask["embedding"]
        self.embed = target.embed_weight.float()  # shared with the target (no embed_tokens exported)
        self.head = self.w.get("lm_head.weight", target.lm_head_weight.float())
        self.d2t = self.w.get("d2t")
        c = self.cfg
        self.eps, self.hd = c["rms_norm_eps"], c["head_dim"]
        self.nh, self.nkv = c["num_attention_heads"], c["num_key_value_heads"]
        theta = c["rope_parameters"]["rope_theta"]
        self.inv_freq = 1.0 / theta ** (torch.arange(0, self.hd, 2).double() / self.hd)

    def _norm(self, x, name):
        return F.rms_norm(x, (x.shape[-1],), self.w[name], self.eps)

    def _rope(self, x, positions):
        """Neox-style rotation of the two halves of each head. x [T, n, hd], positions [T]."""
        ang = positions.double()[:, None] * self.inv_freq  # [T, hd/2]
        cos, sin = ang.cos().float()[:, None], ang.sin().float()[:, None]
        a, b = x[..., : self.hd // 2], x[..., self.hd // 2 :]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    def _kv(self, p, x, positions):
        k = (x @ self.w[p + "self_attn.k_proj.weight"].T).view(len(x), self.nkv, self.hd)
        k = self._rope(self._norm(k, p + "self_attn.k_norm.weight"), positions)
        return k, (x @ self.w[p + "self_attn.v_proj.weight"].T).view(len(x), self.nkv, self.hd)

    def draft(self, features: torch.Tensor, anchor: int) -> tuple[torch.Tensor, torch.Tensor]:
        """features [C, L·D] of positions 0..C-1, anchor token at position C →
        (hidden [H, D] of the masked slots after the final norm, draft ids [H] in target ids)."""
        C, S = features.shape[0], self.cfg["block_size"]
        # precompute_and_store_context_kv: fc, then hidden_norm once, then every layer's K/V of it.
        ctx = self._norm(features @ self.w["fc.weight"].T, "hidden_norm.weight")  # [C, D]
        ctx_pos, blk_pos = torch.arange(C), torch.arange(C, C + S)
        ids = torch.tensor([anchor] + [self.mask_id] * (S - 1))
        x = torch.where((ids == self.mask_id)[:, None], self.mask_vec, self.embed[ids])  # [S, D]
        residual = None
        for n in range(self.cfg["num_hidden_layers"]):
            p = f"layers.{n}."
            residual = x if residual is None else x + residual  # fused add + RMSNorm
            h = self._norm(residual, p + "input_layernorm.weight")
            q = (h @ self.w[p + "self_attn.q_proj.weight"].T).view(S, self.nh, self.hd)
            q = self._rope(self._norm(q, p + "self_attn.q_norm.weight"), blk_pos)
            k_ctx, v_ctx = self._kv(p, ctx, ctx_pos)
            k_blk, v_blk = self._kv(p, h, blk_pos)
            k = torch.cat([k_ctx, k_blk]).repeat_interleave(self.nh // self.nkv, dim=1)  # [C+S, nh, hd]
            v = torch.cat([v_ctx, v_blk]).repeat_interleave(self.nh // self.nkv, dim=1)
            att = torch.einsum("qhd,khd->hqk", q, k) * self.hd**-0.5  # non-causal: all C + S keys
            o = torch.einsum("hqk,khd->qhd", att.softmax(-1), v).reshape(S, -1)
            residual = o @ self.w[p + "self_attn.o_proj.weight"].T + residual
            h = self._norm(residual, p + "post_attention_layernorm.weight")
            gate, up = h @ self.w[p + "mlp.gate_proj.weight"].T, h @ self.w[p + "mlp.up_proj.weight"].T
            x = (F.silu(gate) * up) @ self.w[p + "mlp.down_proj.weight"].T
        hidden = self._norm(x + residual, "norm.weight")[1:]  # [H, D]
        draft = (hidden @ self.head.T).argmax(-1)  # [H] draft-vocabulary ids
        return hidden, draft if self.d2t is None else draft + self.d2t[draft]


def _ours(drafter: BlockDrafter, features: torch.Tensor, anchor: int):
    cache = drafter.new_context_cache(1, features.shape[0] + 1)
    drafter.extend_context(features[None], cache)
    block = drafter.draft(torch.tensor([anchor]), cache)
    return block.hidden[0], block.cand_ids[0, :, 0]


def _features(target, drafter: BlockDrafter, ids: torch.Tensor) -> torch.Tensor:
    """The target's context features [T, L·D] of `ids` [T]."""
    out = target(ids[None], target.new_cache(1, len(ids)), feature_layers=drafter.config.target_layer_ids)
    return out.features[0].float()


def _check_agree(target, drafter: BlockDrafter, out: Path, prompts: list[torch.Tensor], *, atol: float) -> float:
    ref = VllmOrderDrafter(out, target)
    worst = 0.0
    for ids in prompts:
        feats = _features(target, drafter, ids[:-1])
        h_ours, ids_ours = _ours(drafter, feats, int(ids[-1]))
        h_vllm, ids_vllm = ref.draft(feats, int(ids[-1]))
        worst = max(worst, (h_ours - h_vllm).abs().max().item())
        assert torch.equal(ids_ours, ids_vllm), (ids_ours, ids_vllm)
    assert worst < atol, worst
    return worst


def _random_checkpoint(target, path: Path, draft_vocab: int | None) -> BlockDrafter:
    """A drafter with non-trivial norm weights (so the folding is exercised) and a selector tensor."""
    torch.manual_seed(0)
    d2t = torch.randperm(target.vocab_size)[:draft_vocab].sort().values if draft_vocab else None
    cfg = DrafterConfig.for_target(target, draft_vocab_size=draft_vocab, top_k=4)
    drafter = BlockDrafter(cfg, target, draft_to_target=d2t).eval()
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            scale = 0.5 if "norm" in name else 0.05
            p.add_(torch.randn_like(p) * scale)
    save_drafter(drafter, path, extra_tensors={"selector.gate.weight": torch.ones(3)}, meta={"selector": {"name": "drelay"}})
    return drafter


@pytest.fixture(scope="module")
def tiny():
    return load_target(TINY)


@pytest.mark.parametrize("draft_vocab", [None, 96])
def test_export_matches_vllm_order(tiny, tmp_path, draft_vocab):
    drafter = _random_checkpoint(tiny, tmp_path / "ckpt", draft_vocab)
    assert drelay(["export", "--format", "vllm", "--target", TINY, str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 0
    out = tmp_path / "out"
    cfg = json.loads((out / CONFIG).read_text())
    assert cfg["architectures"] == [ARCHITECTURE] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"]["target_layer_ids"] == list(drafter.config.target_layer_ids)
    assert cfg.get("draft_vocab_size") == draft_vocab
    assert "drelay_selector/" in (out / NOTE).read_text()
    saved = read_selector_dir(out)  # the selector beside the drafter, where vLLM's loader never looks
    assert saved.selector["name"] == "drelay" and list(saved.tensors) == ["selector.gate.weight"]
    assert saved.drafter.to_dict() == drafter.config.to_dict()
    assert sorted(p.name for p in out.glob("*.safetensors")) == [WEIGHTS]
    torch.manual_seed(1)
    prompts = [torch.randint(0, tiny.vocab_size, (n,)) for n in (3, 9, 20)]
    _check_agree(tiny, drafter, out, prompts, atol=1e-4)


@pytest.mark.slow
def test_bundled_checkpoint_matches_vllm_order(tmp_path):
    target = load_target("smollm2-135m", pack=False)
    ckpt = BUNDLED_CHECKPOINTS / "smollm2-135m"
    assert drelay(["export", "--format", "vllm", str(ckpt), str(tmp_path / "out")]) == 0
    drafter, _, _ = load_drafter(ckpt, target)
    text = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
            "def fibonacci(n):\n    if n < 2:\n        return n\n    return"]  # fmt: skip
    prompts = [torch.tensor(target.tokenizer(t)["input_ids"]) for t in text]
    worst = _check_agree(target, drafter, tmp_path / "out", prompts, atol=1e-3)
    print(f"bundled checkpoint: max |dh| = {worst:.2e}")


def test_bad_input_is_one_line_and_writes_nothing(tiny, tmp_path, capsys):
    _random_checkpoint(tiny, tmp_path / "ckpt", None)
    not_a_drafter = tmp_path / "plain"
    not_a_drafter.mkdir()
    (not_a_drafter / "config.json").write_text("{}")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("keep")
    cases = [(str(not_a_drafter), str(tmp_path / "o1"), "missing"), (str(tmp_path / "ckpt"), str(taken), "already exists")]
    for ckpt, out, words in cases:
        capsys.readouterr()
        assert drelay(["export", "--format", "vllm", "--target", TINY, ckpt, out]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err, err
    assert not (tmp_path / "o1").exists() and [p.name for p in taken.iterdir()] == ["x"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "plain", "taken"]  # no temp dir left
