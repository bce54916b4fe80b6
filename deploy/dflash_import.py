"""`drelay import --format dflash SRC OUT`: a DFlash draft-model directory, as z-lab, SpecForge and
vLLM write it, → our drafter checkpoint (`drafter.safetensors` + `drafter_config.json`), exactly.

The source: `config.json` with `architectures: ["DFlashDraftModel"]`, a Qwen3 layer config,
`dflash_config: {mask_token_id, target_layer_ids}`, the block size (`block_size`, or
`num_speculative_tokens` = block − 1), optionally `draft_vocab_size`; every `*.safetensors` in the
directory's root under DFlash's names; optionally `mask_embedding.pt` (the vector substituted for
`mask_token_id`). The target's embedding and LM head are shared when the checkpoint omits them.

DFlash's layer (`model_executor/models/qwen3_dflash.py` in vLLM, z-lab's `DFlashDraftModel`) and
ours compute the same thing once `DrafterConfig.context_layer_norm` is False: the projected
context c = hidden_norm(W_fc f) enters every layer's K/V as it is, and each layer's
`input_layernorm` normalises the block only. Names, ours ← DFlash's (N = layer):

    fc.weight ← fc.weight;  ctx_norm.weight ← hidden_norm.weight;  norm.weight ← norm.weight
    layers.N.in_norm ← layers.N.input_layernorm;  layers.N.post_norm ← layers.N.post_attention_layernorm
    layers.N.{q,k,v,o}_proj, {q,k}_norm ← layers.N.self_attn.*;  {gate,up,down}_proj ← layers.N.mlp.*
    mask_embedding [D] ← mask_embedding.pt, else the embedding row of mask_token_id
    draft_to_target [V_draft] ← sort(arange(V_draft) + d2t)   (lm_head rows must be the target's)

`dflash_config.attention_value_scale` s folds into v_proj (V = s · W_v h for the block and the
context alike). What our drafter cannot run is refused with one line naming the field: its own
embedding or LM head (rows unequal to the target's), projection biases, sliding-window or causal
attention, attention sinks, non-default RoPE, other activations, quantised weights (module
`UNSUPPORTED`). Errors happen before anything is written; the output appears by one rename.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from drelay_model.atomic import atomic_directory
from drelay_model.drafter import DrafterConfig, TargetFingerprint
from drelay_model.drafter.checkpoint import CONFIG as OUR_CONFIG
from drelay_model.drafter.checkpoint import WEIGHTS as OUR_WEIGHTS
from drelay_model.errors import DRelayError

ARCHITECTURE = "DFlashDraftModel"
CONFIG = "config.json"
MASK_FILE = "mask_embedding.pt"

# Our per-layer names → DFlash's (under `layers.N.`).
LAYER_NAMES = {
    "in_norm": "input_layernorm", "post_norm": "post_attention_layernorm",
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj", "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",
    "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj",
}  # fmt: skip
TOP_NAMES = {"fc.weight": "fc.weight", "ctx_norm.weight": "hidden_norm.weight", "norm.weight": "norm.weight"}
# Other spellings vLLM's loader accepts for the same tensors.
ALIASES = {"midlayer.": "layers.0.", "encoder.output_norm_enc.": "hidden_norm.", "encoder.fc.": "fc."}
SHARED = ("embed_tokens.weight", "lm_head.weight", "d2t")  # optional; checked against the target


def _flag(doc: dict, key: str):
    return doc.get(key, (doc.get("dflash_config") or {}).get(key))


# field → (is unsupported?, why): what a DFlash config can ask for that our drafter does not compute.
UNSUPPORTED = {
    "attention_bias": (lambda d: bool(d.get("attention_bias")), "projection biases (our projections have none)"),
    "layer_types": (lambda d: any(t != "full_attention" for t in d.get("layer_types") or ()), "sliding-window layers"),
    "use_swa": (lambda d: bool(_flag(d, "use_swa")), "sliding-window attention"),
    "is_causal": (lambda d: bool(_flag(d, "is_causal") or _flag(d, "causal")), "causal block attention (ours is bidirectional)"),
    "attention_sink_bias": (lambda d: bool(_flag(d, "attention_sink_bias") or d.get("add_swa_attention_sink_bias")), "attention sinks"),
    "attention_mode": (lambda d: any(str(m).lower() not in ("gqa", "mha") for m in
                       [_flag(d, "attention_mode") or "gqa", *(_flag(d, "attention_modes") or ())]), "MLA/KDA attention"),
    "is_neox_style": (lambda d: d.get("is_neox_style", True) is not True, "interleaved RoPE (ours rotates halves)"),
    "rope_parameters": (lambda d: (d.get("rope_parameters") or {}).get("rope_type", "default") != "default"
                        or (d.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0) != 1.0
                        or bool(d.get("rope_scaling")), "scaled or partial RoPE"),
    "hidden_act": (lambda d: d.get("hidden_act", "silu") != "silu", "an activation other than SiLU"),
    "logit_scale": (lambda d: d.get("logit_scale", 1.0) != 1.0, "scaled logits"),
    "use_aux_hidden_state": (lambda d: _flag(d, "use_aux_hidden_state") is False, "no target features (no fc)"),
    "quantization_config": (lambda d: d.get("quantization_config") is not None, "quantised weights"),
}  # fmt: skip


def _int(doc: dict, key: str, src, default: int | None = None) -> int:
    value = doc.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise DRelayError(f"'{src}': {CONFIG} field {key} must be an integer, got {value!r}")
    return value


def _block_size(doc: dict, src) -> int:
    """S from `block_size` (top level or dflash_config) and/or `num_speculative_tokens` (= S − 1)."""
    dflash = doc.get("dflash_config") or {}
    found = {}
    if "block_size" in doc:
        found["block_size"] = doc["block_size"]
    if "block_size" in dflash:
        found["dflash_config.block_size"] = dflash["block_size"]
    if "num_speculative_tokens" in doc:
        found["num_speculative_tokens + 1"] = _int(doc, "num_speculative_tokens", src) + 1
    if not found:
        raise DRelayError(f"'{src}': {CONFIG} has no block_size (nor num_speculative_tokens)")
    if len(set(found.values())) > 1:
        raise DRelayError(f"'{src}': block_size disagrees: {', '.join(f'{k} = {v}' for k, v in found.items())}")
    return _int({"block_size": next(iter(found.values()))}, "block_size", src)


def drafter_config(doc: dict, target, src, *, top_k: int) -> tuple[DrafterConfig, int]:
    """A DFlash config.json (parsed) → (our DrafterConfig bound to `target`, mask_token_id), or one
    line naming the field that does not fit `target` or our drafter."""
    if doc.get("architectures") != [ARCHITECTURE]:
        raise DRelayError(f"'{src}': {CONFIG} architectures is {doc.get('architectures')!r}, not ['{ARCHITECTURE}']")
    if doc.get("model_type", "qwen3") != "qwen3":
        raise DRelayError(f"'{src}': {CONFIG} model_type is {doc['model_type']!r}; a DFlash drafter's layers are Qwen3's")
    for field, (unsupported, what) in UNSUPPORTED.items():
        if unsupported(doc):
            raise DRelayError(f"'{src}': {CONFIG} {field}: {what} cannot be imported (our drafter does not compute it)")
    dflash = doc.get("dflash_config")
    if not isinstance(dflash, dict):
        raise DRelayError(f"'{src}': {CONFIG} has no dflash_config")
    D = _int(doc, "hidden_size", src)
    checks = [
        ("hidden_size", D, target.hidden_size),
        ("target_hidden_size", doc.get("target_hidden_size") or D, target.hidden_size),
        ("vocab_size", _int(doc, "vocab_size", src), target.vocab_size),
        ("num_target_layers", doc.get("num_target_layers", target.num_layers), target.num_layers),
    ]
    for field, theirs, ours in checks:
        if theirs != ours:
            raise DRelayError(f"'{src}': {field} {theirs} does not match target '{target.name}' ({ours})")
    ids = dflash.get("target_layer_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and 0 <= i < target.num_layers for i in ids):
        raise DRelayError(
            f"'{src}': dflash_config.target_layer_ids {ids!r} must be layer ids of target '{target.name}' (0..{target.num_layers - 1})"
        )
    if ids != sorted(set(ids)):  # the engines concatenate the captured layers in layer order
        raise DRelayError(f"'{src}': dflash_config.target_layer_ids {ids} must be strictly ascending")
    mask_id = dflash.get("mask_token_id")
    if isinstance(mask_id, bool) or not isinstance(mask_id, int) or not 0 <= mask_id < target.vocab_size:
        raise DRelayError(f"'{src}': dflash_config.mask_token_id {mask_id!r} is not a token id of target '{target.name}'")
    theta = (doc.get("rope_parameters") or {}).get("rope_theta", doc.get("rope_theta"))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise DRelayError(f"'{src}': {CONFIG} has no rope_theta (in rope_parameters or at the top level)")
    draft_vocab = doc.get("draft_vocab_size")
    heads = _int(doc, "num_attention_heads", src)
    fields = dict(
        hidden_size=D,
        target_layer_ids=tuple(ids),
        num_layers=_int(doc, "num_hidden_layers", src),
        num_heads=heads,
        num_kv_heads=_int(doc, "num_key_value_heads", src, heads),
        head_dim=_int(doc, "head_dim", src, D // heads if heads else 0),
        intermediate_size=_int(doc, "intermediate_size", src),
        block_size=_block_size(doc, src),
        top_k=top_k,
        rms_norm_eps=float(doc.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        draft_vocab_size=None if draft_vocab in (None, target.vocab_size) else _int(doc, "draft_vocab_size", src),
        context_layer_norm=False,
        target=TargetFingerprint.of(target),
    )
    try:
        return DrafterConfig(**fields), mask_id
    except DRelayError as exc:
        raise DRelayError(f"'{src}': {exc}") from None


def read_tensors(src: Path) -> dict[str, torch.Tensor]:
    """Every `*.safetensors` in `src`'s root (as vLLM loads them), under DFlash's names; `t2d` (the
    inverse map, which vLLM ignores too) dropped."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise DRelayError(f"'{src}' has no *.safetensors")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            part = load_file(str(path))
        except (SafetensorError, OSError, ValueError) as exc:
            raise DRelayError(f"'{path}' is corrupted ({exc})") from None
        for name, value in part.items():
            for old, new in ALIASES.items():
                name = name.replace(old, new)
            if name in tensors:
                raise DRelayError(f"'{src}': tensor {name} appears in more than one *.safetensors")
            if name != "t2d":
                tensors[name] = value
    return tensors


def expected_shapes(config: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """DFlash name → shape, for every tensor a DFlash checkpoint of `config` must hold."""
    D, hd, n_in = config.hidden_size, config.head_dim, len(config.target_layer_ids) * config.hidden_size
    q, kv, I = config.num_heads * hd, config.num_kv_heads * hd, config.intermediate_size
    per_layer = {
        "in_norm": (D,), "post_norm": (D,), "q_proj": (q, D), "k_proj": (kv, D), "v_proj": (kv, D),
        "o_proj": (D, q), "q_norm": (hd,), "k_norm": (hd,), "gate_proj": (I, D), "up_proj": (I, D), "down_proj": (D, I),
    }  # fmt: skip
    shapes = {"fc.weight": (D, n_in), "hidden_norm.weight": (D,), "norm.weight": (D,)}
    for n in range(config.num_layers):
        shapes.update({f"layers.{n}.{LAYER_NAMES[k]}.weight": s for k, s in per_layer.items()})
    return shapes


def _same(theirs: torch.Tensor, ours: torch.Tensor) -> bool:
    """Equal in the coarser of the two dtypes (a bf16 checkpoint of a float32 target, or the reverse)."""
    dtype = theirs.dtype if theirs.element_size() <= ours.element_size() else ours.dtype
    return theirs.shape == ours.shape and torch.equal(theirs.to(dtype), ours.to(dtype))


def drafter_tensors(
    config: DrafterConfig,
    tensors: dict[str, torch.Tensor],
    target,
    src,
    *,
    mask_id: int,
    mask_vector: torch.Tensor | None,
    value_scale: float | None,
) -> dict[str, torch.Tensor]:
    """DFlash tensors → our drafter's (module docstring), each checked for presence and shape; the
    shared embedding / head, where shipped, checked equal to the target's."""
    shapes = expected_shapes(config)
    missing = sorted(set(shapes) - set(tensors))
    if missing:
        raise DRelayError(
            f"'{src}': missing tensor {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    allowed = set(shapes) | {"embed_tokens.weight", "lm_head.weight"} | ({"d2t"} if config.draft_vocab_size else set())
    unexpected = sorted(set(tensors) - allowed)
    if unexpected:
        raise DRelayError(f"'{src}': unexpected tensor {unexpected[0]} (our drafter has no such weight)")
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != shape:
            raise DRelayError(f"'{src}': tensor {name} has shape {tuple(tensors[name].shape)}, the config implies {shape}")
    dtype = tensors["fc.weight"].dtype
    embed = tensors.get("embed_tokens.weight")
    if embed is not None and not _same(embed, target.embed_weight.detach().cpu()):
        raise DRelayError(
            f"'{src}': embed_tokens.weight differs from target '{target.name}''s embedding (our drafter shares the target's)"
        )
    out = {ours: tensors[theirs] for ours, theirs in TOP_NAMES.items()}
    for n in range(config.num_layers):
        out.update({f"layers.{n}.{ours}.weight": tensors[f"layers.{n}.{theirs}.weight"] for ours, theirs in LAYER_NAMES.items()})
        if value_scale is not None:  # V = s · W_v h, context and block alike
            v = out[f"layers.{n}.v_proj.weight"]
            out[f"layers.{n}.v_proj.weight"] = (v.float() * value_scale).to(v.dtype)
    if mask_vector is None:  # the mask token's embedding row, as DFlash embeds masked slots
        mask_vector = (embed if embed is not None else target.embed_weight.detach().cpu())[mask_id]
    out["mask_embedding"] = mask_vector.reshape(-1).to(dtype)
    if out["mask_embedding"].shape != (config.hidden_size,):
        raise DRelayError(f"'{src}': {MASK_FILE} holds {mask_vector.numel()} values, not hidden_size {config.hidden_size}")
    head = _draft_head(config, tensors, target, src)
    if head is not None:
        out["draft_to_target"] = head
    return {k: v.contiguous() for k, v in out.items()}


def _draft_head(config: DrafterConfig, tensors: dict[str, torch.Tensor], target, src) -> torch.Tensor | None:
    """The draft vocabulary: draft_to_target [V_draft] int64, sorted, from `d2t` (target id = draft id
    + d2t[draft id]); `lm_head` must be the target's rows there (ours proposes through them)."""
    full = target.lm_head_weight.detach().cpu()
    head = tensors.get("lm_head.weight")
    if config.draft_vocab_size is None:
        if head is not None and not _same(head, full):
            raise DRelayError(
                f"'{src}': lm_head.weight differs from target '{target.name}''s LM head (our drafter proposes through the target's)"
            )
        return None
    V_draft = config.draft_vocab_size
    d2t = tensors.get("d2t")
    if d2t is None or head is None:
        raise DRelayError(f"'{src}': draft_vocab_size {V_draft} needs tensors d2t and lm_head.weight")
    if d2t.shape != (V_draft,) or d2t.is_floating_point():
        raise DRelayError(f"'{src}': tensor d2t must be [{V_draft}] integers, got {tuple(d2t.shape)} {d2t.dtype}")
    ids = torch.arange(V_draft) + d2t.long()  # [V_draft] target ids
    if ids.min() < 0 or ids.max() >= target.vocab_size or ids.unique().numel() != V_draft:
        raise DRelayError(f"'{src}': tensor d2t maps draft ids outside, or twice into, target '{target.name}''s vocabulary")
    if not _same(head, full[ids]):
        raise DRelayError(
            f"'{src}': lm_head.weight rows differ from target '{target.name}''s LM-head rows at d2t (ours proposes through the target's)"
        )
    return ids.sort().values  # a permutation of the draft ids: the same head, in our sorted convention


def _mask_file(src: Path, mask_id: int) -> torch.Tensor | None:
    """`mask_embedding.pt`: a tensor, or {"mask_token_id", "embedding"} (vLLM's two forms)."""
    path = src / MASK_FILE
    if not path.is_file():
        return None
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same one-line error
        raise DRelayError(f"'{path}' is corrupted ({type(exc).__name__})") from None
    if isinstance(state, dict):
        if state.get("mask_token_id", mask_id) != mask_id:
            raise DRelayError(
                f"'{path}': mask_token_id {state.get('mask_token_id')} differs from dflash_config.mask_token_id {mask_id}"
            )
        state = state.get("embedding")
    if not isinstance(state, torch.Tensor) or not state.is_floating_point():
        raise DRelayError(f"'{path}' holds no embedding tensor")
    return state


def import_dflash(src: str | Path, out: str | Path, *, target, top_k: int = 16) -> tuple[Path, DrafterConfig]:
    """Import the DFlash directory `src` as a drafter checkpoint for `target` in the new directory
    `out` (absent or empty), atomically. Returns (out, the drafter's config)."""
    src, out = Path(src), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DRelayError(f"output '{out}' already exists and is not an empty directory")
    if not (src / CONFIG).is_file():
        raise DRelayError(f"'{src}' is not a DFlash draft-model directory (no {CONFIG})")
    try:
        doc = json.loads((src / CONFIG).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DRelayError(f"'{src / CONFIG}' is not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise DRelayError(f"'{src / CONFIG}' is not a JSON object")
    config, mask_id = drafter_config(doc, target, src, top_k=top_k)
    scale = doc["dflash_config"].get("attention_value_scale")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise DRelayError(f"'{src}': dflash_config.attention_value_scale must be a number, got {scale!r}")
    tensors = drafter_tensors(config, read_tensors(src), target, src, mask_id=mask_id,
                              mask_vector=_mask_file(src, mask_id), value_scale=scale)  # fmt: skip
    from safetensors.torch import save_file

    meta = {"imported": {"format": "dflash", "source": str(src), "mask_token_id": mask_id}}
    with atomic_directory(out) as tmp:
        save_file(tensors, str(tmp / OUR_WEIGHTS), metadata={"format": "pt"})
        (tmp / OUR_CONFIG).write_text(json.dumps({"drafter": config.to_dict(), "meta": meta}, indent=2))
    return out, config
