"""The SGLang-runner form of our draft model (runner_math.py, runner.py) on CPU, without SGLang:
the context K/V the DFLASH worker materialises through the model's hooks, written into a toy paged
KV pool at shuffled slots, then the dense-block forward with a reference for RadixAttention, give
our drafter's hidden states and pool; the full draft side (pool → seam) gives the engine's
selector path. SGLang-marked: the interface matches SGLang's own DFLASH draft model."""

from __future__ import annotations

import importlib.util
import inspect
import json
from types import SimpleNamespace

import pytest
import torch

from deploy.sglang.export import export_sglang
from deploy.sglang.model import drafter_config_from_hf
from deploy.sglang.runner import DRelayRunnerModel
from deploy.sglang.runner_math import DraftRunner, reference_block_attention
from drelay_model.errors import DRelayError
from drelay_model.kernels.cpu_linear import CpuKernels
from drelay_model.selectors import SelectionContext
from drelay_model.target import tiny_target
from tests.deploy.test_sglang_export import trained_checkpoint

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
needs_sglang = pytest.mark.skipif(
    not (HAVE_SGLANG and torch.cuda.is_available()), reason="needs SGLang installed (docs/sglang.md) and a GPU"
)
ATOL = 1e-5  # float32; our drafter batches rows under one masked SDPA, the reference loops them


PLAIN = CpuKernels(packed=False)  # both sides on F.linear: differences are then the attention's only


@pytest.fixture(scope="module")
def target():
    # features from layers 1, 2: never the last (SGLang cannot capture it); its drafter and selector take PLAIN
    return tiny_target("tiny-qwen3", layers=4, cpu_kernels=PLAIN)


def exported(target, tmp_path, draft_vocab=None):
    """(our drafter, its selector, the export dir, the export's tensors as SGLang's loader yields them)."""
    from safetensors.torch import load_file

    drafter, selector = trained_checkpoint(target, tmp_path / "ckpt", draft_vocab=draft_vocab)
    out = export_sglang(tmp_path / "ckpt", tmp_path / "out", dtype="float32", context_length=4096)
    return drafter, selector, out, load_file(str(out / "model.safetensors"))


def runner_from(out, tensors, cls=DraftRunner):
    cfg = json.loads((out / "config.json").read_text())
    model = cls(drafter_config_from_hf(cfg)) if cls is DraftRunner else cls(cfg)
    model.load_weights(tensors.items())
    return model.eval()


class ToyPagedKV:
    """A paged draft KV: per layer k/v [slots, n_kv, hd]; row b's position p lives at slot
    req_to_token[b, p] (shuffled). `materialise` makes the worker's per-layer calls."""

    def __init__(self, model: DraftRunner, bs: int, max_len: int, seed: int) -> None:
        a = model.layers[0].self_attn
        n = bs * max_len + 3
        self.k = [torch.zeros(n, a.num_kv_heads, a.head_dim) for _ in model.layers]
        self.v = [torch.zeros(n, a.num_kv_heads, a.head_dim) for _ in model.layers]
        self.req_to_token = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[: bs * max_len].view(bs, max_len)

    def materialise(self, model: DraftRunner, feats: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> None:
        """Packed verified features feats [T, L·D] of rows [T] at positions [T]."""
        loc = self.req_to_token[rows, positions]
        c = model.project_target_hidden(feats)
        for i, layer in enumerate(model.layers):
            attn = layer.self_attn
            k, v = attn.kv_proj_only(model.prepare_context_hidden_for_kv(layer, c))
            k = attn.apply_k_rope(positions, attn.apply_k_norm(k))
            self.k[i][loc] = k.view(-1, attn.num_kv_heads, attn.head_dim)
            self.v[i][loc] = v.view(-1, attn.num_kv_heads, attn.head_dim)

    def attends(self, model: DraftRunner, lens: torch.Tensor) -> list:
        """Per layer: the reference RadixAttention over each row's context read from the pool."""
        C = int(lens.max())
        a = model.layers[0].self_attn
        return [
            reference_block_attention(
                self.k[i][self.req_to_token[:, :C]],
                self.v[i][self.req_to_token[:, :C]],
                lens,
                block_size=model.block_size,
                num_heads=a.num_heads,
                head_dim=a.head_dim,
            )
            for i in range(len(model.layers))
        ]


def scenario(drafter, target, seed=0):
    """Three rows with different verified lengths: features, anchors, packed (rows, positions)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor([4, 9, 6])
    feats = torch.randn(3, 9, len(drafter.config.target_layer_ids) * target.hidden_size, generator=g)
    anchors = torch.randint(0, target.vocab_size, (3,), generator=g)
    rows = torch.cat([torch.full((int(n),), b) for b, n in enumerate(lens)])
    positions = torch.cat([torch.arange(int(n)) for n in lens])
    return lens, feats, anchors, rows, positions


def drafter_reference(drafter, lens, feats, anchors):
    """Our drafter: block hidden [3, S, D] at anchors = lens (context p < anchor), its pool."""
    C = feats.shape[1]
    with torch.no_grad():
        ctx = drafter.context_kv(feats, torch.arange(C).expand(3, C))
        h = drafter.block_hidden(anchors[:, None], lens[:, None], ctx)[:, 0]
    return h, drafter.pool(h[:, 1:])


def runner_block(model, target, lens, anchors, pool: ToyPagedKV, mask_id=0):
    """The worker's draft block: ids [anchor, mask, …], the target's embedding of them, positions
    lens + 0..S-1 → hidden [3·S, D]."""
    S = model.block_size
    ids = torch.full((3, S), mask_id)
    ids[:, 0] = anchors
    embeds = target.embed_weight[ids].view(3 * S, -1)
    positions = (lens[:, None] + torch.arange(S)).view(-1)
    with torch.no_grad():
        return model.block_hidden(embeds, positions, pool.attends(model, lens))


def test_context_kv_equals_the_drafter_per_layer(target, tmp_path):
    drafter, _, out, tensors = exported(target, tmp_path)
    model = runner_from(out, tensors)
    feats = torch.randn(1, 7, model.fc.in_features)
    with torch.no_grad():
        ref = drafter.context_kv(feats, torch.arange(7)[None])
        got = model.context_kv(feats[0], torch.arange(7))
    for (rk, rv), (k, v) in zip(ref, got):
        assert torch.equal(k, rk[0].transpose(0, 1)) and torch.equal(v, rv[0].transpose(0, 1))


@pytest.mark.parametrize("draft_vocab", [None, 200])
def test_paged_block_forward_reproduces_the_drafter_hidden_states_and_pool(target, tmp_path, draft_vocab):
    drafter, _, out, tensors = exported(target, tmp_path, draft_vocab)
    model = runner_from(out, tensors)
    lens, feats, anchors, rows, positions = scenario(drafter, target)
    h_ref, block = drafter_reference(drafter, lens, feats, anchors)
    pool = ToyPagedKV(model, 3, 9, seed=1)
    with torch.no_grad():
        pool.materialise(model, feats[rows, positions], rows, positions)  # packed, as a prefill delivers them
    S, D = model.block_size, target.hidden_size
    h = runner_block(model, target, lens, anchors, pool).view(3, S, D)
    assert torch.allclose(h, h_ref, atol=ATOL, rtol=0)
    ids, logq = model.candidates(h[:, 1:].reshape(-1, D), model.draft_head(target.lm_head_weight))
    assert torch.equal(ids.view_as(block.cand_ids), block.cand_ids)
    assert torch.allclose(logq.view_as(block.cand_logq), block.cand_logq, atol=ATOL, rtol=0)
    # (b): whatever id the worker fills the masked slots with, they start from mask_embedding.
    assert torch.equal(runner_block(model, target, lens, anchors, pool, mask_id=7).view(3, S, D), h)


def test_context_without_the_per_layer_input_norm_is_not_our_drafter(target, tmp_path):
    """Negative control for (a): SGLang's stock DFlash hook (identity) changes the hidden states."""
    drafter, _, out, tensors = exported(target, tmp_path)
    model = runner_from(out, tensors)
    lens, feats, anchors, rows, positions = scenario(drafter, target, seed=2)
    h_ref, _ = drafter_reference(drafter, lens, feats, anchors)
    model.prepare_context_hidden_for_kv = lambda layer, c: c
    pool = ToyPagedKV(model, 3, 9, seed=3)
    with torch.no_grad():
        pool.materialise(model, feats[rows, positions], rows, positions)
    h = runner_block(model, target, lens, anchors, pool).view_as(h_ref)
    assert (h - h_ref).abs().max() > 1e-3


class RefRadix:
    """Stands in for a layer's RadixAttention: attn(q, k, v, forward_batch) → reference attention."""

    def __init__(self, attend):
        self.attend = attend

    def __call__(self, q, k, v, forward_batch):
        return self.attend(q, k, v)


def test_runner_model_draft_side_gives_the_engine_selector_path(target, tmp_path):
    """DRelayRunnerModel end to end on CPU: draft_hidden through per-layer `attn` objects, the
    worker's lm_head attach, compute_candidates, bind_selector + seam → the engine selector's path."""
    drafter, selector, out, tensors = exported(target, tmp_path, draft_vocab=200)
    model = runner_from(out, tensors, cls=DRelayRunnerModel)
    assert model.config.hidden_size == target.hidden_size and model.supports_fused_context_kv is False
    lens, feats, anchors, rows, positions = scenario(drafter, target, seed=4)
    _, block = drafter_reference(drafter, lens, feats, anchors)
    pool = ToyPagedKV(model, 3, 9, seed=5)
    with torch.no_grad():
        pool.materialise(model, feats[rows, positions], rows, positions)
    for layer, attend in zip(model.layers, pool.attends(model, lens)):
        layer.self_attn.attn = RefRadix(attend)
    S = model.block_size
    ids = torch.zeros(3, S, dtype=torch.long)
    ids[:, 0] = anchors
    hidden = model.draft_hidden(
        (lens[:, None] + torch.arange(S)).view(-1), target.embed_weight[ids].view(3 * S, -1), forward_batch=None
    )
    model.lm_head = SimpleNamespace(weight=target.lm_head_weight)  # what the worker attaches
    assert "lm_head" not in dict(model.named_modules())
    hs = hidden.view(3, S, -1)[:, 1:]  # as _SelectorDraftSampler slices it
    cand, logq = model.compute_candidates(hs.reshape(-1, hs.shape[-1]))
    assert torch.equal(cand.view_as(block.cand_ids), block.cand_ids)
    model.bind_selector(target.embed_weight, cpu_kernels=PLAIN)
    seam = model.selector_seam(max_requests=5, max_bs=4)
    slots = torch.tensor([4, 0, 2])
    seam.history.append(slots, feats, lens)
    seam.stage_requests(slots)
    scores = seam.build_lattice(cand.view_as(block.cand_ids), logq.view_as(block.cand_logq), hs, anchors)
    tokens, q = seam.sample_path(candidate_ids=cand.view_as(block.cand_ids), scores=scores)
    history, mask = seam.history.read(slots)
    ctx = SelectionContext(anchor_ids=anchors, anchor_pos=lens, row_ids=torch.arange(3), history=history, history_mask=mask)
    with torch.no_grad():
        ref = selector.select(block, ctx)
    assert torch.equal(tokens, ref.path_ids)


def test_load_weights_checks_names_and_shapes(target, tmp_path):
    _, _, out, tensors = exported(target, tmp_path)
    cfg = drafter_config_from_hf(json.loads((out / "config.json").read_text()))
    kept = DraftRunner(cfg).load_weights(tensors.items())
    assert kept == set(tensors) and not any(n.startswith("drelay_selector.") for n in dict(DraftRunner(cfg).named_parameters()))
    for bad, needle in [
        ({k: v for k, v in tensors.items() if k != "fc.weight"}, "missing"),
        ({**tensors, "layers.0.self_attn.g_proj.weight": torch.zeros(1)}, "not part"),
        ({**tensors, "fc.weight": torch.zeros(2, 2)}, "shape"),
    ]:
        with pytest.raises(DRelayError, match=needle):
            DraftRunner(cfg).load_weights(bad.items())
    model = DraftRunner(cfg)
    with pytest.raises(ValueError, match="dense blocks"):
        model.block_inputs(torch.zeros(model.block_size + 1, cfg.hidden_size))
    with pytest.raises(ValueError, match="block size"):
        model.set_block_size(cfg.block_size + 1)


def test_export_names_a_mask_token_id_for_the_worker(target, tmp_path):
    _, _, out, _ = exported(target, tmp_path)
    dflash = json.loads((out / "config.json").read_text())["dflash_config"]
    assert dflash["mask_token_id"] == 0 and dflash["mask_token"] == "<|drelay_mask|>"
    from drelay_model.drafter import BlockDrafter, DrafterConfig, save_drafter

    unsorted = DrafterConfig.for_target(target, num_layers=1, target_layer_ids=(1, 0))
    save_drafter(BlockDrafter(unsorted, target), tmp_path / "unsorted")
    with pytest.raises(DRelayError, match="ascending"):
        export_sglang(tmp_path / "unsorted", tmp_path / "out2", dtype="float32", context_length=4096)


@pytest.mark.sglang
@needs_sglang
def test_interface_matches_sglangs_dflash_draft_model():
    """Every hook DFlashWorkerV2 calls on SGLang's DFlashDraftModel exists here, forward takes the
    runner's arguments, and the registry's class attaches one RadixAttention per layer."""
    from sglang.srt.models.dflash import DFlashAttention, DFlashDraftModel

    hooks = [
        "forward",
        "load_weights",
        "set_block_size",
        "project_target_hidden",
        "prepare_context_hidden_for_kv",
        "get_input_embeddings",
    ]
    assert all(callable(getattr(DRelayRunnerModel, h, None)) and hasattr(DFlashDraftModel, h) for h in hooks)
    ours = list(inspect.signature(DRelayRunnerModel.forward).parameters)
    theirs = list(inspect.signature(DFlashDraftModel.forward).parameters)
    assert ours[:4] == theirs[:4] == ["self", "input_ids", "positions", "forward_batch"] and "input_embeds" in ours
    from deploy.sglang.runner_math import DraftAttention

    for h in ("kv_proj_only", "apply_k_norm", "apply_k_rope"):
        assert callable(getattr(DraftAttention, h)) and hasattr(DFlashAttention, h)


def test_draft_head_is_built_once_in_the_drafter_dtype(target, tmp_path):
    """The worker attaches the target's head (bf16 on GPUs) to a draft model in another dtype: the
    draft head is cast once at attach time, and `candidates` never copies a head per call."""
    drafter, selector, out, tensors = exported(target, tmp_path, draft_vocab=200)
    model = runner_from(out, tensors, cls=DRelayRunnerModel)
    model.lm_head = SimpleNamespace(weight=target.lm_head_weight.to(torch.bfloat16))
    assert model._draft_head.dtype == model.fc.weight.dtype == torch.float32
    hidden = torch.randn(4, model.drafter_config.hidden_size)
    model.compute_candidates(hidden)
    with pytest.raises(DRelayError, match="draft head dtype"):
        model.candidates(hidden, model._draft_head.to(torch.bfloat16))
