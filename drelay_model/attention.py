"""Masked grouped-query attention in one fused kernel per device: the drafter's block attention and
the target's prefill/verify attention.

    out = softmax(q kᵀ / √hd + bias) v          q [B, nh, Q, hd]; k, v [B, nkv, Ck, hd]
    query head h reads kv head h // (nh / nkv); mask [B, 1, Q, Ck] bool (True = attend) or None.

Paths, chosen once per device type (`attention_path`; `ATTENTION_PATHS` maps device → path):
  sdpa-gqa       (cpu)  `F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=…)`:
                        torch's CPU flash kernel takes the bool mask and the grouped heads; it keeps
                        no scores, only the mask it converts to the compute dtype on every call.
  sdpa-expanded  (cuda) the same call on CUDA can run only the math kernel (flash takes no mask,
                        the memory-efficient kernel no grouped heads), which keeps [B, nh, Q, Ck]
                        fp32 scores per layer for backward. Instead k, v are repeated to nh heads
                        (repeat_interleave: exactly the grouping above), the mask becomes one
                        additive bias in the compute dtype, built once per forward and shared by
                        every layer (rows padded to 16 keys, so the kernel reads it in place), and
                        SDPA is restricted to the memory-efficient kernel: a shape it cannot run
                        raises instead of falling back to the math kernel. Without a mask (one
                        decoded token, or one block over the whole context) in half precision,
                        the flash kernel reads the grouped heads unexpanded.
  math           the reference: explicit scores and softmax (tests; what the fallback costs).
The planner (`drelay_model/training/memory_plan.py`) prices each path.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SDPA_GQA = "sdpa-gqa"
SDPA_EXPANDED = "sdpa-expanded"
MATH = "math"
PATHS = (SDPA_GQA, SDPA_EXPANDED, MATH)
# Device type → path. Devices not listed take SDPA_GQA (torch picks its kernel there).
ATTENTION_PATHS = {"cpu": SDPA_GQA, "cuda": SDPA_EXPANDED}
_BIAS_ALIGN = 16  # keys per bias row are padded to a multiple of this (memory-efficient kernel alignment)
# Set only inside `forced_attention_path`; a plain module global, which torch.compile reads (and
# guards on) without a graph break.
_forced_path: str | None = None


def attention_path(device: torch.device | str) -> str:
    """The attention path code on `device` takes (see the module docstring)."""
    if _forced_path is not None:
        return _forced_path
    return ATTENTION_PATHS.get(torch.device(device).type, SDPA_GQA)


@contextlib.contextmanager
def forced_attention_path(path: str):
    """Run every attention in this context on `path`, whatever the device (tests, measurements;
    one thread)."""
    global _forced_path
    if path not in PATHS:
        raise ValueError(f"attention path must be one of {PATHS}, got {path!r}")
    previous, _forced_path = _forced_path, path
    try:
        yield
    finally:
        _forced_path = previous


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype attention runs in for activations `x`: autocast's when it is on, else x's own."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


def prepare_mask(mask: torch.Tensor | None, path: str, dtype: torch.dtype) -> torch.Tensor | None:
    """The mask in the form `attend` takes on `path`; build it once per forward, share it by layers.

    sdpa-expanded: bias [B, 1, Q, Ck] in `dtype`, 0 where mask is True and −inf elsewhere, a view
    into storage whose rows hold Ck rounded up to 16 keys. Other paths: the bool mask unchanged.
    """
    if mask is None or path != SDPA_EXPANDED:
        return mask
    B, _, Q, Ck = mask.shape
    padded = math.ceil(Ck / _BIAS_ALIGN) * _BIAS_ALIGN
    bias = torch.full((B, 1, Q, padded), float("-inf"), dtype=dtype, device=mask.device)
    bias[..., :Ck].masked_fill_(mask, 0.0)
    return bias[..., :Ck]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, path: str) -> torch.Tensor:
    """q [B, nh, Q, hd], k/v [B, nkv, Ck, hd], mask from `prepare_mask` (or None) → [B, nh, Q, hd]."""
    groups = q.shape[1] // k.shape[1]
    if path == SDPA_GQA:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=groups > 1)
    dtype = compute_dtype(q)  # cast before expanding: autocast would cast the nh-head copies
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if path == SDPA_EXPANDED and q.is_cuda and mask is None and dtype in (torch.float16, torch.bfloat16):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # no mask (decode): flash reads grouped heads as they are
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=groups > 1)
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)  # [B, nh, Ck, hd]: query head h reads kv head h // groups
        v = v.repeat_interleave(groups, dim=1)
    if path == MATH:
        return reference_attention(q, k, v, mask)
    if q.is_cuda:
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """softmax(q kᵀ / √hd + mask) v with explicit [B, nh, Q, Ck] scores; k, v already [B, nh, Ck, hd].
    mask: bool (True = attend) or an additive bias."""
    scores = (q @ k.transpose(-1, -2)).float() / math.sqrt(q.shape[-1])  # [B, nh, Q, Ck]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    return (scores.softmax(dim=-1).to(v.dtype) @ v).to(q.dtype)
