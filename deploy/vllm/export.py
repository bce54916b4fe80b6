"""`drelay export --format vllm <checkpoint> <out>`: a drafter checkpoint → a draft-model directory
that vLLM's DFlash speculative decoding loads as it is (`speculative_config={"method": "dflash",
"model": <out>, "num_speculative_tokens": block_size - 1}`).

vLLM's DFlash layer order (`model_executor/models/qwen3_dflash.py`, 0.32) differs from ours in one
place: it normalises the projected context once (`hidden_norm`) and feeds it to every layer's K/V
projection as it is, while ours applies `ctx_norm` and then each layer's own `in_norm`. With
n(y) = y / rms(y) (the unweighted RMSNorm, scale-invariant: n(a·y) = n(y) for a > 0):

    ours, context  K_l = W_k · (w_in,l ⊙ n(w_ctx ⊙ n(F f)))      = W_k · diag(w_in,l) · n(diag(w_ctx) F f)
    ours, block    Q_l = W_q · (w_in,l ⊙ n(x))                   = W_q · diag(w_in,l) · n(x)

(up to epsilon), so the export folds the norm weights into the linears: `fc` = diag(w_ctx) · F
(rows scaled), `q/k/v_proj` = W · diag(w_in,l) (columns scaled), and `hidden_norm` and every
`input_layernorm` become ones. Everything else maps one to one. A drafter already in DFlash's
layout (`context_layer_norm: false`, what `drelay import` writes) maps by name only.

Draft vocabulary: vLLM's head is `lm_head` [V_draft, D] with `d2t` [V_draft] such that target id =
draft id + d2t[draft id]; we export lm_head = the target's LM-head rows `draft_to_target` and
d2t = draft_to_target − arange. Without one, vLLM shares the target's embedding and head.

The learned mask vector goes in `mask_embedding.pt` (vLLM substitutes it wherever the input id is
`dflash_config.mask_token_id`). vLLM would substitute it for a real anchor that equals that id too,
so the export picks a token the drafter is least likely to meet: the largest id outside the draft
vocabulary (frequency-ranked, so a rare token), else the last id of the vocabulary. A collision
can only cost acceptance, never change the output (verification decides).

A trained selector (`selector.*` tensors and `meta.selector`) goes in the `drelay_selector/`
subfolder (selector_dir.py), where vLLM's loader never looks: vLLM alone drafts natively from the
export, and with this package's plugin (plugin.py) the selector chooses the drafts.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from deploy.draft_config import architecture_fields
from deploy.vllm.selector_dir import SELECTOR_DIR, write_selector_dir
from drelay_model.atomic import atomic_directory
from drelay_model.drafter import DrafterConfig, read_checkpoint
from drelay_model.errors import DRelayError

ARCHITECTURE = "DFlashDraftModel"
MODEL_TYPE = "qwen3"
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
MASK_FILE = "mask_embedding.pt"
NOTE = "README.md"
MAX_POSITIONS = 32_768  # the draft's RoPE table; vLLM caps it by the target's max_model_len

# Our per-layer names → vLLM's (under `layers.N.`). The norms folded into linears are not here.
_LAYER_NAMES = {
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj", "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",
    "post_norm": "post_attention_layernorm", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}  # fmt: skip


def vllm_tensors(
    config: DrafterConfig, tensors: dict[str, torch.Tensor], head_weight: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """Our drafter tensors → vLLM's DFlash names, with `ctx_norm` and each `in_norm` folded in.

    Args:
        tensors      the checkpoint's drafter tensors (fc [D, L·D], ctx_norm [D], layers.N.*, norm [D],
                     draft_to_target [V_draft] when there is a draft vocabulary; selector.* ignored).
        head_weight  the target's LM head [V, D] (needed only with a draft vocabulary).
    Returns:
        name → float tensor (and `d2t` int64), contiguous, in the checkpoint's dtype.
    """
    D = config.hidden_size
    fold = config.context_layer_norm  # False: already DFlash's layout (an import), names only
    w_ctx = tensors["ctx_norm.weight"]  # [D]
    out = {
        "fc.weight": tensors["fc.weight"] * w_ctx[:, None] if fold else tensors["fc.weight"],  # rows: diag(w_ctx) · F
        "hidden_norm.weight": torch.ones_like(w_ctx) if fold else w_ctx,
        "norm.weight": tensors["norm.weight"],
    }
    for n in range(config.num_layers):
        ours, theirs = f"layers.{n}.", f"layers.{n}."
        w_in = tensors[ours + "in_norm.weight"]  # [D]
        for name, mapped in _LAYER_NAMES.items():
            w = tensors[f"{ours}{name}.weight"]
            if fold and name in ("q_proj", "k_proj", "v_proj"):
                w = w * w_in[None, :]  # columns: W · diag(w_in)
            out[f"{theirs}{mapped}.weight"] = w
        out[theirs + "input_layernorm.weight"] = torch.ones(D, dtype=w_in.dtype) if fold else w_in
    if config.draft_vocab_size is not None:
        d2t = tensors["draft_to_target"].long()  # [V_draft], sorted target ids
        out["lm_head.weight"] = head_weight[d2t].to(w_ctx.dtype)
        out["d2t"] = d2t - torch.arange(d2t.shape[0])
    return {k: v.contiguous() for k, v in out.items()}


def mask_token_id(config: DrafterConfig, tensors: dict[str, torch.Tensor], vocab_size: int) -> int:
    """The id vLLM fills masked slots with (see the module docstring)."""
    if config.draft_vocab_size is None:
        return vocab_size - 1
    outside = torch.ones(vocab_size, dtype=torch.bool)
    outside[tensors["draft_to_target"].long()] = False
    ids = outside.nonzero()[:, 0]
    return int(ids[-1]) if len(ids) else vocab_size - 1


def vllm_config(config: DrafterConfig, *, vocab_size: int, mask_id: int, dtype: torch.dtype) -> dict:
    """config.json of the export: a Qwen3 config that vLLM's DFlash loader reads."""
    doc = {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        **architecture_fields(config, dtype=dtype),
        "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "max_position_embeddings": MAX_POSITIONS,
        "vocab_size": vocab_size,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "dflash_config": {"mask_token_id": mask_id, "target_layer_ids": list(config.target_layer_ids)},
    }
    if config.draft_vocab_size is not None:
        doc["draft_vocab_size"] = config.draft_vocab_size
    return doc


def export_vllm(checkpoint: str | Path, out: str | Path, *, target) -> Path:
    """Export `checkpoint` (a drafter for `target`) to the new directory `out`, atomically."""
    from safetensors.torch import save_file

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DRelayError(f"output '{out}' already exists and is not an empty directory")
    config, tensors, meta = read_checkpoint(checkpoint)
    config.check_target(target)
    own = _drafter_tensor_names(config)
    missing = sorted(own - set(tensors))
    if missing:
        raise DRelayError(f"checkpoint '{checkpoint}' is missing drafter tensors: {', '.join(missing[:5])}")
    head = target.lm_head_weight.detach().float().cpu() if config.draft_vocab_size is not None else None
    exported = vllm_tensors(config, tensors, head)
    mask_id = mask_token_id(config, tensors, target.vocab_size)
    dtype = tensors["fc.weight"].dtype
    skipped = sorted(k for k in tensors if k not in own)
    has_selector = any(k.startswith("selector.") for k in skipped)
    selector = (meta.get("selector") or {}) if has_selector else {}
    if has_selector and not selector.get("name"):
        raise DRelayError(f"checkpoint '{checkpoint}' holds selector tensors but no meta.selector name")
    with atomic_directory(out) as tmp:
        save_file(exported, str(tmp / WEIGHTS), metadata={"format": "pt"})
        torch.save({"mask_token_id": mask_id, "embedding": tensors["mask_embedding"].contiguous()}, tmp / MASK_FILE)
        doc = vllm_config(config, vocab_size=target.vocab_size, mask_id=mask_id, dtype=dtype)
        (tmp / CONFIG).write_text(json.dumps(doc, indent=2))
        (tmp / NOTE).write_text(_note(checkpoint, config, mask_id, skipped, selector.get("name")))
        for path in tmp.iterdir():
            path.chmod(0o644)  # safetensors writes 0600; an export is read by other users' servers
        if selector:
            write_selector_dir(tmp, config, selector, {k: tensors[k] for k in skipped})
    return out


def _drafter_tensor_names(config: DrafterConfig) -> set[str]:
    names = {"fc.weight", "ctx_norm.weight", "norm.weight", "mask_embedding"}
    for n in range(config.num_layers):
        names |= {f"layers.{n}.{p}.weight" for p in (*_LAYER_NAMES, "in_norm")}
    if config.draft_vocab_size is not None:
        names.add("draft_to_target")
    return names


def _note(checkpoint, config: DrafterConfig, mask_id: int, skipped: list[str], selector: str | None) -> str:
    lines = [
        f"# vLLM DFlash draft model exported from `{checkpoint}`",
        "",
        f"Load it with `speculative_config={{\"method\": \"dflash\", \"model\": <this directory>, "
        f"\"num_speculative_tokens\": {config.num_slots}}}` (see docs/vllm.md).",
        "",
        "- Weights: `fc` and each layer's q/k/v projections carry our `ctx_norm` and `in_norm` weights "
        "folded in; `hidden_norm` and `input_layernorm` are ones (vLLM normalises the context once).",
        f"- Masked slots: `mask_embedding.pt` replaces the embedding of token id {mask_id} (`dflash_config.mask_token_id`).",
        "- Draft vocabulary: " + ("`lm_head` = the target's LM-head rows, `d2t` = target id − draft id."
                                  if config.draft_vocab_size else "none (vLLM shares the target's embedding and LM head)."),
        "- Selector: " + (f"the trained '{selector}' selector ({sum(k.startswith('selector.') for k in skipped)} tensors) in `{SELECTOR_DIR}/`, which vLLM's "
                          "loader ignores; vLLM alone drafts natively (argmax), and with this project's vLLM plugin "
                          "(`VLLM_PLUGINS=drelay`, docs/vllm.md) the selector chooses the drafts."
                          if selector else "none (vLLM drafts natively)."),
        "",
    ]  # fmt: skip
    return "\n".join(lines)
