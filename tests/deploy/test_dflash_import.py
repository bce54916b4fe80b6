"""`drelay import --format dflash`: our `--format vllm` export of a drafter, imported back, is the
same drafter (identical pools, equal hidden states, training forward included); the imported
drafter exported again is what vLLM's DFlash order of operations computes; each mismatch with the
target or with what our drafter can compute is one line naming the field, exit 2, nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from deploy.dflash_import import LAYER_NAMES, TOP_NAMES, expected_shapes
from drelay_model.drafter import BlockDrafter, load_drafter
from drelay_model.target import load_target
from cli.main import main as drelay
from tests.deploy.test_vllm_export import TINY, _check_agree, _random_checkpoint

TINY_OTHER = "tiny-qwen3:vocab=320,seed=1"  # the same widths, another vocabulary
TINY_DEEP = "tiny-qwen3:vocab=384,seed=1,layers=4"


@pytest.fixture(scope="module")
def tiny():
    return load_target(TINY)


def _export(ckpt: Path, out: Path) -> Path:
    assert drelay(["export", "--format", "vllm", "--target", TINY, str(ckpt), str(out)]) == 0
    return out


def _import(src: Path, out: Path, *extra: str) -> int:
    return drelay(["import", "--format", "dflash", "--target", TINY, *extra, str(src), str(out)])


def _pools(drafter: BlockDrafter, target, ids: torch.Tensor):
    """Inference (context cache + one block) and training (several blocks at once) outputs."""
    feats = target(ids[None], target.new_cache(1, len(ids)), feature_layers=drafter.config.target_layer_ids).features.float()
    cache = drafter.new_context_cache(1, len(ids) + 1)
    drafter.extend_context(feats[:, :-1], cache)
    block = drafter.draft(ids[-1:], cache)
    anchors = torch.tensor([[2, len(ids) // 2, len(ids) - 1]])
    with torch.no_grad():
        train = drafter(ids[anchors[0]][None], anchors, feats)  # [1, 3, S, D]
    return block, train


@pytest.mark.parametrize("draft_vocab", [None, 96])
def test_export_then_import_is_the_same_drafter(tiny, tmp_path, draft_vocab, capsys):
    original = _random_checkpoint(tiny, tmp_path / "ckpt", draft_vocab)
    _export(tmp_path / "ckpt", tmp_path / "vllm")
    assert _import(tmp_path / "vllm", tmp_path / "back", "--top-k", "4") == 0
    assert "imported" in capsys.readouterr().out
    back, rest, meta = load_drafter(tmp_path / "back", tiny)
    assert rest == {} and meta["imported"]["format"] == "dflash"
    assert back.config.context_layer_norm is False and back.config.block_size == original.config.block_size
    assert back.config.target_layer_ids == original.config.target_layer_ids
    if draft_vocab:
        assert torch.equal(back.draft_to_target, original.draft_to_target)
    torch.manual_seed(2)
    for n in (5, 12, 23):
        ids = torch.randint(0, tiny.vocab_size, (n,))
        (a, train_a), (b, train_b) = _pools(original, tiny, ids), _pools(back, tiny, ids)
        assert torch.equal(a.cand_ids, b.cand_ids)
        torch.testing.assert_close(b.hidden, a.hidden, atol=1e-4, rtol=1e-4)
        # log q in float32 over the whole (draft) vocabulary; the pool's own cand_logq may take its
        # normaliser's tail from a coarse (bf16/int8) ranking pass (BlockDrafter.pool): looser there.
        logq_a, logq_b = (torch.log_softmax(d.logits(x.hidden), -1) for d, x in ((original, a), (back, b)))
        torch.testing.assert_close(logq_b, logq_a, atol=1e-4, rtol=0)
        torch.testing.assert_close(b.cand_logq, a.cand_logq, atol=2e-3, rtol=0)
        torch.testing.assert_close(train_b, train_a, atol=1e-4, rtol=1e-4)
    # The imported drafter (DFlash's layout) exported again is what vLLM's order of operations computes.
    _export(tmp_path / "back", tmp_path / "again")
    prompts = [torch.randint(0, tiny.vocab_size, (n,)) for n in (4, 15)]
    _check_agree(tiny, back, tmp_path / "again", prompts, atol=1e-4)


def test_expected_shapes_are_our_drafters(tiny):
    """The shapes the importer demands, renamed to ours, are BlockDrafter's own state dict."""
    from drelay_model.drafter import DrafterConfig

    config = DrafterConfig.for_target(tiny, top_k=4, context_layer_norm=False)
    ours = {k: tuple(v.shape) for k, v in BlockDrafter(config, tiny).state_dict().items()}
    renamed = {**{f"layers.{n}.{o}.weight": f"layers.{n}.{t}.weight" for n in range(config.num_layers) for o, t in LAYER_NAMES.items()},
               **TOP_NAMES}  # fmt: skip
    theirs = expected_shapes(config)
    assert {k: theirs[renamed[k]] for k in renamed} == {k: v for k, v in ours.items() if k != "mask_embedding"}
    assert set(ours) == set(renamed) | {"mask_embedding"}


def _dflash_dir(tiny, tmp_path: Path, draft_vocab=None) -> Path:
    _random_checkpoint(tiny, tmp_path / "ckpt", draft_vocab)
    return _export(tmp_path / "ckpt", tmp_path / "good")


def _edit(src: Path, dst: Path, *, config=None, tensors=None) -> Path:
    """A copy of the DFlash directory `src` with config.json and/or the weights edited."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if config:
        doc = json.loads((dst / "config.json").read_text())
        config(doc)
        (dst / "config.json").write_text(json.dumps(doc))
    if tensors:
        w = load_file(str(dst / "model.safetensors"))
        tensors(w)
        save_file(w, str(dst / "model.safetensors"))
    return dst


def _trained_norms(w: dict) -> None:
    """DFlash's norms as trained (our export's are ones): hidden_norm and each input_layernorm differ."""
    w.update(
        {k: 1 + 0.3 * torch.randn_like(v) for k, v in w.items() if k.endswith(("input_layernorm.weight", "hidden_norm.weight"))}
    )


def test_dflash_context_layout_is_vllms_order(tiny, tmp_path):
    """A DFlash directory whose hidden_norm and input_layernorms differ, imported: our drafter (in
    DFlash's layout) computes what vLLM's order of operations computes on that very directory."""
    src = _edit(_dflash_dir(tiny, tmp_path), tmp_path / "dflash", tensors=_trained_norms)
    assert _import(src, tmp_path / "back", "--top-k", "4") == 0
    drafter, _, _ = load_drafter(tmp_path / "back", tiny)
    torch.manual_seed(3)
    prompts = [torch.randint(0, tiny.vocab_size, (n,)) for n in (4, 15)]
    _check_agree(tiny, drafter, src, prompts, atol=1e-4)
    _export(tmp_path / "back", tmp_path / "again")  # and exported again, by name: the same directory
    _check_agree(tiny, drafter, tmp_path / "again", prompts, atol=1e-4)


def _set(path: str, value):
    def edit(doc):
        *parents, key = path.split(".")
        for p in parents:
            doc = doc[p]
        doc[key] = value

    return edit


BAD_CONFIGS = [  # (config edit, words the one line must hold)
    (_set("hidden_size", 96), "hidden_size 96 does not match"),
    (_set("vocab_size", 512), "vocab_size 512 does not match"),
    (_set("dflash_config.target_layer_ids", [1, 99]), "target_layer_ids"),
    (_set("dflash_config.target_layer_ids", [1, 0]), "strictly ascending"),
    (_set("num_target_layers", 40), "num_target_layers 40"),
    (_set("num_speculative_tokens", 7), "block_size disagrees"),
    (_set("block_size", 99), "block_size"),
    (lambda d: d.pop("block_size"), "no block_size"),
    (_set("dflash_config.mask_token_id", 10_000), "mask_token_id"),
    (_set("architectures", ["DFlash2DraftModel"]), "architectures"),
    (_set("attention_bias", True), "attention_bias"),
    (_set("layer_types", ["sliding_attention", "full_attention"]), "layer_types"),
    (_set("is_neox_style", False), "is_neox_style"),
    (_set("num_attention_heads", 6), "tensor layers.0.self_attn.q_proj.weight has shape"),
]


def _fails(src: Path, out: Path, words: str, capsys, *extra: str) -> None:
    capsys.readouterr()
    assert _import(src, out, *extra) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err
    assert not out.exists()


def test_bad_imports_are_one_line_and_write_nothing(tiny, tmp_path, capsys):
    good = _dflash_dir(tiny, tmp_path)
    for i, (edit, words) in enumerate(BAD_CONFIGS):
        _fails(_edit(good, tmp_path / f"c{i}", config=edit), tmp_path / f"o{i}", words, capsys)
    bad_tensors = [
        (lambda w: w.pop("layers.1.mlp.up_proj.weight"), "missing tensor layers.1.mlp.up_proj.weight"),
        (
            lambda w: w.update({"layers.0.self_attn.q_proj.bias": torch.zeros(3)}),
            "unexpected tensor layers.0.self_attn.q_proj.bias",
        ),
        (lambda w: w.update({"fc.weight": w["fc.weight"][:, :-1].contiguous()}), "tensor fc.weight has shape"),
        (lambda w: w.update({"lm_head.weight": torch.randn(tiny.vocab_size, tiny.hidden_size)}), "lm_head.weight differs"),
        (
            lambda w: w.update({"embed_tokens.weight": torch.randn(tiny.vocab_size, tiny.hidden_size)}),
            "embed_tokens.weight differs",
        ),
    ]
    for i, (edit, words) in enumerate(bad_tensors):
        _fails(_edit(good, tmp_path / f"t{i}", tensors=edit), tmp_path / f"u{i}", words, capsys)
    _fails(good, tmp_path / "other", "vocab_size", capsys, "--target", TINY_OTHER)  # the other target's vocabulary
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("keep")
    capsys.readouterr()
    assert _import(good, tmp_path / "taken") == 2 and "already exists" in capsys.readouterr().err
    _fails(tmp_path / "ckpt", tmp_path / "o-ours", "not a DFlash draft-model directory", capsys)  # our own format
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["x"]
    assert not [p for p in tmp_path.iterdir() if ".tmp." in p.name]  # no temp dir left behind


def test_bad_draft_vocabulary_is_one_line(tiny, tmp_path, capsys):
    good = _dflash_dir(tiny, tmp_path, draft_vocab=96)

    def shift_d2t(w):
        w["d2t"] = w["d2t"].clone()
        w["d2t"][0] += 1  # two draft ids now name the same target id, or the head rows move

    cases = [
        (lambda w: w.pop("d2t"), "needs tensors d2t and lm_head.weight"),
        (shift_d2t, "d2t"),
        (lambda w: w.update({"lm_head.weight": w["lm_head.weight"].flip(0).contiguous()}), "lm_head.weight rows differ"),
    ]
    for i, (edit, words) in enumerate(cases):
        _fails(_edit(good, tmp_path / f"v{i}", tensors=edit), tmp_path / f"w{i}", words, capsys)


def test_mask_row_value_scale_and_shared_embedding(tiny, tmp_path):
    """Without mask_embedding.pt the masked slots start from the mask token's embedding row; an
    attention_value_scale s lands in v_proj; an embed_tokens equal to the target's is accepted."""
    from safetensors.torch import load_file

    good = _dflash_dir(tiny, tmp_path)
    src = _edit(good, tmp_path / "plain", config=_set("dflash_config.attention_value_scale", 0.5),
                tensors=lambda w: w.update({"embed_tokens.weight": tiny.embed_weight.detach().clone()}))  # fmt: skip
    (src / "mask_embedding.pt").unlink()
    assert _import(src, tmp_path / "out") == 0
    ours = load_file(str(tmp_path / "out" / "drafter.safetensors"))
    theirs = load_file(str(good / "model.safetensors"))
    mask_id = json.loads((src / "config.json").read_text())["dflash_config"]["mask_token_id"]
    assert torch.equal(ours["mask_embedding"], tiny.embed_weight[mask_id].to(ours["mask_embedding"].dtype))
    assert torch.equal(ours["layers.1.v_proj.weight"], theirs["layers.1.self_attn.v_proj.weight"] * 0.5)
    assert torch.equal(ours["layers.1.k_proj.weight"], theirs["layers.1.self_attn.k_proj.weight"])


def test_imported_drafter_exported_for_sglang_keeps_dflash_context_layout(tiny, tmp_path):
    """The SGLang runner of an imported drafter writes the context K/V our drafter computes (no
    per-layer input norm on the context)."""
    from safetensors.torch import load_file

    from deploy.sglang.export import export_sglang
    from tests.deploy.test_sglang_runner import runner_from

    deep = load_target(TINY_DEEP)  # SGLang cannot read the last layer's features: more layers
    _random_checkpoint(deep, tmp_path / "ckpt", None)
    assert drelay(["export", "--format", "vllm", "--target", TINY_DEEP, str(tmp_path / "ckpt"), str(tmp_path / "vllm")]) == 0
    src = _edit(tmp_path / "vllm", tmp_path / "dflash", tensors=_trained_norms)
    args = ["import", "--format", "dflash", "--target", TINY_DEEP, "--top-k", "4", str(src), str(tmp_path / "back")]
    assert drelay(args) == 0
    drafter, _, _ = load_drafter(tmp_path / "back", deep)
    out = export_sglang(tmp_path / "back", tmp_path / "sglang", context_length=2048, dtype="float32")
    model = runner_from(out, load_file(str(out / "model.safetensors")))
    feats = torch.randn(1, 7, model.fc.in_features)
    with torch.no_grad():
        ref = drafter.context_kv(feats, torch.arange(7)[None])
        got = model.context_kv(feats[0], torch.arange(7))
    for (rk, rv), (k, v) in zip(ref, got):
        torch.testing.assert_close(k, rk[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(v, rv[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
