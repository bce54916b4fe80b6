"""The Hugging Face config fields that describe a drafter's Qwen3-style architecture, shared by the
SGLang and vLLM exports (each adds its own architecture name, vocabulary and DFlash block)."""

from __future__ import annotations

import torch

from drelay_model.drafter import DrafterConfig


def architecture_fields(config: DrafterConfig, *, dtype: torch.dtype) -> dict:
    """Widths, depth, heads, norm and RoPE settings, block size and `torch_dtype` of `config`."""
    return {
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "block_size": config.block_size,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
