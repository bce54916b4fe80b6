"""The export's name map, and `DRelayDraftModel`: an exported DRelay checkpoint bound to *our*
target (pure PyTorch, for our own engine and the round-trip tests). Inside SGLang the class the
registry resolves is models/drelay_draft.py's (runner.py's math on SGLang's paged KV).

An export (export.py) is an HF-style directory: `config.json` with `architectures =
["DRelayDraftModel"]` and `model.safetensors` under the names below. Our drafter differs from
SGLang's DFlash draft model in three ways, all handled here rather than folded into weights:
  - the context K/V apply each layer's input norm to the projected features
    (k_p = W_k RMSNorm_in(RMSNorm_ctx(W_fc f_p))); DFlash feeds RMSNorm_ctx(W_fc f_p) directly (as
    does a drafter imported from DFlash, `context_layer_norm: false`);
  - the masked slots start from a learned vector `mask_embedding` [D], not the embedding row of a
    mask token;
  - the pool goes through a frozen LM head that may be a frequency-ranked subset of the target's
    rows (`d2t` maps draft ids to target ids).
None of these can be folded exactly (an RMSNorm is not linear; no token row equals a learned
vector), so both classes run our own drafter math (here: BlockDrafter; in SGLang: runner_math.py).
The frozen embedding and LM head are the target's: `bind_target` shares them (they are never
exported), as SGLang shares its target's.

Names (ours → exported), N = layer index:
  fc.weight → fc.weight;  ctx_norm.weight → hidden_norm.weight;  norm.weight → norm.weight
  mask_embedding → mask_embedding.weight;  draft_to_target → d2t
  layers.N.in_norm → layers.N.input_layernorm;  layers.N.post_norm → layers.N.post_attention_layernorm
  layers.N.{q,k,v,o}_proj, {q,k}_norm → layers.N.self_attn.*;  layers.N.{gate,up,down}_proj → layers.N.mlp.*
  selector.* → drelay_selector.*   (the trained selector, config in config.json["drelay_selector"])
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from drelay_model.drafter import BlockDrafter, DrafterConfig
from drelay_model.errors import DRelayError
from drelay_model.selectors import Selector, default_registry

ARCHITECTURE = "DRelayDraftModel"
MODEL_TYPE = "qwen3"  # a type transformers knows: SGLang reads the draft config with AutoConfig while parsing args
WEIGHTS = "model.safetensors"
CONFIG = "config.json"

_FIXED = {
    "ctx_norm.weight": "hidden_norm.weight",
    "mask_embedding": "mask_embedding.weight",
    "draft_to_target": "d2t",
}
_LAYER = {
    "in_norm": "input_layernorm",
    "post_norm": "post_attention_layernorm",
    **{p: f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")},
    **{p: f"mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")},
}
_LAYER_RE = re.compile(r"^layers\.(\d+)\.([a-z_]+)\.(weight)$")


def exported_name(name: str) -> str:
    """Our state-dict name → the exported (HF/SGLang-style) name."""
    if name in _FIXED:
        return _FIXED[name]
    if name.startswith("selector."):
        return "drelay_selector." + name.removeprefix("selector.")
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _LAYER:
        return f"layers.{m.group(1)}.{_LAYER[m.group(2)]}.weight"
    return name


def internal_name(name: str) -> str:
    """The inverse of `exported_name`."""
    inverse = {v: k for k, v in _FIXED.items()}
    if name in inverse:
        return inverse[name]
    if name.startswith("drelay_selector."):
        return "selector." + name.removeprefix("drelay_selector.")
    m = re.match(r"^layers\.(\d+)\.(self_attn\.|mlp\.)?([a-z_]+)\.weight$", name)
    if m:
        ours = {v: k for k, v in _LAYER.items()}.get((m.group(2) or "") + m.group(3))
        if ours:
            return f"layers.{m.group(1)}.{ours}.weight"
    return name


def drafter_config_from_hf(cfg: dict) -> DrafterConfig:
    """config.json → our DrafterConfig (the inverse of export.hf_config)."""
    try:
        return DrafterConfig.from_dict(cfg["drelay_drafter"])
    except (KeyError, TypeError) as exc:
        raise DRelayError(f"{CONFIG} is not a DRelay export (no 'drelay_drafter' section)") from exc


class DRelayDraftModel(nn.Module):
    """The exported drafter (+ selector). Constructed like an SGLang model class
    (`config, quant_config=None, prefix=""`), filled by `load_weights`, made runnable by
    `bind_target` (the target's frozen embedding, LM head and final-norm initialisation)."""

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        super().__init__()
        self.hf_config = config if isinstance(config, dict) else config.to_dict()
        self.drafter_config = drafter_config_from_hf(self.hf_config)
        self._weights: dict[str, torch.Tensor] = {}
        self.drafter: BlockDrafter | None = None
        self.selector: Selector | None = None
        self.candidate_selector = None  # the DFlash-2 seam; the plugin's worker installs it (seam.py)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Take (exported name, tensor) pairs; returns the names it kept."""
        for name, tensor in weights:
            self._weights[internal_name(name)] = tensor
        return {exported_name(n) for n in self._weights}

    def bind_target(self, target) -> "DRelayDraftModel":
        """Build the drafter and selector on `target` (anything exposing embed_weight,
        lm_head_weight, final_norm_weight, hidden_size, vocab_size, num_layers, name, config)."""
        cfg = self.drafter_config
        drafter = BlockDrafter(cfg, target, draft_to_target=self._weights.get("draft_to_target"))
        own = drafter.state_dict()
        missing = sorted(set(own) - set(self._weights))
        if missing:
            raise DRelayError(
                f"exported checkpoint is missing drafter tensors: {', '.join(exported_name(n) for n in missing[:5])}"
            )
        drafter.load_state_dict({k: v for k, v in self._weights.items() if k in own})
        self.drafter = drafter.eval()
        saved = self.hf_config.get("drelay_selector") or {}
        if saved:
            extra = {k: v for k, v in self._weights.items() if k.startswith("selector.")}
            self.selector = default_registry().from_checkpoint(
                saved["name"], drafter=self.drafter, tensors=extra, meta={"selector": saved}
            )
        return self

    def compute_candidates(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot hidden states [N, D] → (candidate ids [N, K] target ids, log q [N, K]): the pool
        under the drafter's full softmax, as the selector seam expects."""
        block = self.drafter.pool(hidden[:, None])  # [N, 1, K]
        return block.cand_ids[:, 0], block.cand_logq[:, 0]

    def selector_seam(self, *, max_requests: int, max_bs: int, device="cpu"):
        """The DFlash-2 `candidate_selector` for this model (seam.py), with a verified-feature ring
        for `max_requests` request-pool slots; None when the export holds no selector."""
        from deploy.sglang.seam import seam_for

        return seam_for(
            self.selector,
            self.drafter_config,
            dtype=self.drafter.fc.weight.dtype,
            max_requests=max_requests,
            max_bs=max_bs,
            device=device,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path, target) -> "DRelayDraftModel":
        """Load an export directory and bind it to `target`."""
        from safetensors.torch import load_file

        path = Path(path)
        if not (path / CONFIG).is_file() or not (path / WEIGHTS).is_file():
            raise DRelayError(f"'{path}' is not an exported draft model (needs {CONFIG} and {WEIGHTS})")
        cfg = json.loads((path / CONFIG).read_text())
        if ARCHITECTURE not in cfg.get("architectures", []):
            raise DRelayError(f"'{path}/{CONFIG}' architectures {cfg.get('architectures')} do not include {ARCHITECTURE}")
        model = cls(cfg)
        model.load_weights(load_file(str(path / WEIGHTS)).items())
        return model.bind_target(target)
