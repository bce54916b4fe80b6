"""`DRelayRunnerModel`: our draft model as SGLang's DFLASH draft runner drives it.

The interface is the one `DFlashWorkerV2` (SGLang 0.5.23, read in its source) expects of a DFLASH
draft model, with our math from runner_math.py behind it:
  constructor   (config, quant_config=None, prefix="")            config: the export's HF config
  load_weights  (exported name, tensor) pairs (safetensors as exported; no renaming)
  forward       (input_ids [N], positions [N], forward_batch, input_embeds [N, D]) →
                LogitsProcessorOutput(next_token_logits=None, hidden_states [N, D]); N = bs·S
                dense blocks; each layer's RadixAttention (non-causal) writes the block's K/V
                into the draft KV and reads the row's context + block
  context KV    project_target_hidden, prepare_context_hidden_for_kv, layers[i].self_attn
                .{kv_proj_only, apply_k_norm, apply_k_rope, num_kv_heads, head_dim, attn};
                `supports_fused_context_kv = False` keeps the worker on its per-layer path (its
                fused kernel would skip our per-layer input norm)
  pool          lm_head (the worker attaches the target's head before graph capture),
                compute_candidates(hidden [N, D]) → (target ids [N, K], log q [N, K]),
                candidate_selector (the seam, installed by the plugin's worker)
  also read     config.hidden_size, block_size / set_block_size, lilicorr, get_input_embeddings
sglang is imported only in `attach_radix_attention` and `forward` (never at import); the rest
runs on CPU without it (tests/deploy/test_sglang_runner.py). The class SGLang's registry resolves
is models/drelay_draft.py's `DRelayDraftModel`, which attaches RadixAttention on construction.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from deploy.sglang.model import drafter_config_from_hf
from deploy.sglang.runner_math import DraftRunner
from drelay_model.errors import DRelayError
from drelay_model.kernels.cpu_linear import CpuKernels


class DRelayRunnerModel(DraftRunner):
    supports_fused_context_kv = False
    is_nemotron_35_draft = False  # the worker embeds block tokens with the target's embedding

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        hf = config if isinstance(config, dict) else config.to_dict()
        super().__init__(drafter_config_from_hf(hf))
        if quant_config is not None:
            raise DRelayError("DRELAY draft models are not quantized (got a quant_config)")
        self.hf_config = hf
        self.config = config if not isinstance(config, dict) else SimpleNamespace(**config)
        self.candidate_selector = None  # the seam; the plugin's worker installs it
        self.lilicorr = None
        self.selector = None
        self.lm_head = None

    def __setattr__(self, name, value) -> None:
        # The worker attaches the target's LM head module here before graph capture. Kept as a
        # plain attribute (not a submodule: its weights stay the target's), and the draft head
        # [V_draft, D] (rows d2t, in the drafter's dtype) is built once now, outside any captured
        # graph, so no call copies the vocabulary head.
        if name == "lm_head":
            object.__setattr__(self, "lm_head", value)
            object.__setattr__(
                self,
                "_draft_head",
                None if value is None else self.draft_head(value.weight).to(self.fc.weight.dtype).contiguous(),
            )
            return
        super().__setattr__(name, value)

    # ---- SGLang-only pieces (lazy imports) ------------------------------------------------------
    def attach_radix_attention(self) -> None:
        """One RadixAttention per layer (layer_id = index): non-causal, so block tokens see the
        whole block and the row's materialised context. TP = 1 only."""
        from sglang.srt.layers.radix_attention import AttentionType, RadixAttention
        from sglang.srt.runtime_context import get_parallel

        if int(get_parallel().tp_size) != 1:
            raise DRelayError(f"DRELAY draft models run with tensor parallelism 1 (got tp_size={get_parallel().tp_size})")
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            a.attn = RadixAttention(
                num_heads=a.num_heads,
                head_dim=a.head_dim,
                scaling=a.head_dim**-0.5,
                num_kv_heads=a.num_kv_heads,
                layer_id=i,
                attn_type=AttentionType.ENCODER_ONLY,
            )

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch, input_embeds=None, get_embedding=False, pp_proxy_tensors=None):
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput

        return LogitsProcessorOutput(
            next_token_logits=None, hidden_states=self.draft_hidden(positions, input_embeds, forward_batch)
        )

    # ---- pure torch -----------------------------------------------------------------------------
    def draft_hidden(self, positions: torch.Tensor, input_embeds: torch.Tensor | None, forward_batch) -> torch.Tensor:
        """The block forward through each layer's `attn(q, k, v, forward_batch)`. positions [N],
        input_embeds [N, D] (the target's embedding of [anchor, mask, …] per row) → [N, D]."""
        if input_embeds is None:
            raise DRelayError(
                "the DRELAY draft forward needs input_embeds (the worker embeds block tokens with the target's embedding)"
            )
        if input_embeds.shape[0] == 0:  # an idle batch
            return input_embeds.to(self.fc.weight.dtype)
        attends = [lambda q, k, v, a=layer.self_attn.attn: a(q, k, v, forward_batch) for layer in self.layers]
        return self.block_hidden(input_embeds, positions, attends)

    def get_input_embeddings(self):
        return None  # no embedding of our own: the target's is used

    def compute_candidates(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot hidden states [N, D] → (target ids [N, K], log q [N, K]) for the selector seam."""
        if self._draft_head is None:
            raise RuntimeError("DRELAY draft_model.lm_head unset (the worker attaches the target's head before capture)")
        return self.candidates(hidden, self._draft_head)

    def bind_selector(self, embed_weight: torch.Tensor, *, cpu_kernels: CpuKernels | None = None) -> None:
        """Build the exported selector on the target's input embedding [≥ V, D] (it shares it,
        as in training), on that tensor's device, in the drafter's dtype. No-op without one.
        cpu_kernels: its linears' CPU kernel settings (default `CpuKernels.from_env()`; they apply
        only to float32 CPU weights, so never on a GPU)."""
        saved = self.hf_config.get("drelay_selector") or {}
        if not saved:
            return
        from drelay_model.selectors import default_registry

        if self.block_size != self.drafter_config.block_size:
            raise DRelayError(
                f"the DRELAY selector was trained for blocks of {self.drafter_config.block_size}; "
                f"run with --speculative-num-draft-tokens {self.drafter_config.block_size}"
            )
        kernels = cpu_kernels if cpu_kernels is not None else CpuKernels.from_env()
        view = SimpleNamespace(config=self.drafter_config, embed_weight=embed_weight, cpu_kernels=kernels)  # what selectors read
        tensors = {"selector." + k.removeprefix("drelay_selector."): v for k, v in self.extra_tensors.items()}
        with torch.device(embed_weight.device):  # built beside the embedding it shares
            selector = default_registry().from_checkpoint(saved["name"], drafter=view, tensors=tensors, meta={"selector": saved})
        self.selector = selector.to(device=embed_weight.device, dtype=self.fc.weight.dtype).eval()

    def selector_seam(self, *, max_requests: int, max_bs: int, device="cpu"):
        """The `candidate_selector` (seam.py) with its verified-feature ring; None without a selector."""
        from deploy.sglang.seam import seam_for

        return seam_for(
            self.selector,
            self.drafter_config,
            dtype=self.fc.weight.dtype,
            max_requests=max_requests,
            max_bs=max_bs,
            device=device,
        )
