"""Pre-packed oneDNN linears for inference on CPU: the frozen target, the drafter, the DRelay selector.

Verification runs the target on 1 + L tokens at once. On CPU, PyTorch's float32 `F.linear` takes a
matrix-vector path for one token and a GEMM for two or more that re-packs the weight on every call:
on this 2-core machine SmolLM2's LM head (49,152 × 576) took 12 ms for one row, 27 ms for two and
31 ms for sixteen, so verifying even one drafted token cost almost twice an AR step. oneDNN's linear
on a weight packed once (`torch.ops.mkldnn._reorder_linear_weight`) reads the weight as it is:
8 / 9 / 12.6 ms for 1 / 2 / 16 rows. It also computes a row identically whatever the number of rows
beside it (max |Δ| = 0 between a row alone and in a batch of 16, against 6e-5 for the eager pair),
which can only help greedy AR and verification agree.

Inference only (no autograd through the packed op), float32 CPU tensors only; everything else (bf16
autocast in training's feature forward, CUDA) falls back to `F.linear`, so packing never changes
what runs off this path. `DRELAY_PACKED_LINEARS=0` (or `set_enabled(False)`) turns it off
everywhere; `benchmarks/bench_packed.py` measures each phase of a round with it on and off.

A weight can also be packed in bfloat16 (`pack(w, torch.bfloat16)`) where oneDNN runs bf16 natively
(AVX512-BF16 / AMX): it reads half the bytes, and its input and output are rounded to bf16. The
drafter uses it only to rank its draft vocabulary (`BlockDrafter.pool`): its 16,384 × 576 head is
the largest weight a draft reads, and in decoding it comes from memory every round (the target
streams ~540 MB per step through a 32 MB L3). The pool's members then get float32 logits, so the
drafter's hidden states, and replay's agreement with real decoding, stay exact. Rounding the
drafter's layers as well saved 0.3 ms a draft but made replay diverge from real decoding (an
ulp of float32 difference upstream becomes a bf16 rounding step). `DRELAY_BF16_POOL=0` (or
`set_bf16_enabled(False)`) ranks in float32.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

BATCH_HINT = 16  # rows the packed layout is tuned for: H + 1 = 16 for the CPU default's verify
_enabled = os.environ.get("DRELAY_PACKED_LINEARS", "1") != "0"
_bf16_enabled = os.environ.get("DRELAY_BF16_POOL", "1") != "0"


def set_enabled(on: bool) -> None:
    """Use packed weights where they exist (True) or always F.linear (False); for benchmarks."""
    global _enabled
    _enabled = bool(on)


def set_bf16_enabled(on: bool) -> None:
    """Allow bfloat16-packed weights (True, where the CPU runs bf16 natively) or never (False)."""
    global _bf16_enabled
    _bf16_enabled = bool(on)


def available() -> bool:
    """oneDNN is built in and exposes the packed-linear ops."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def bf16_available() -> bool:
    """Packing in bfloat16 is on and this CPU runs it natively (emulated bf16 would be slower)."""
    return _enabled and _bf16_enabled and available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """A packed copy in `dtype` (float32 or bfloat16) of a float32 CPU weight [out, in], or None
    where packing does not apply."""
    if not _enabled or not available() or weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    if dtype == torch.bfloat16 and not bf16_available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype), BATCH_HINT)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias), through the packed weight when it applies. x [..., in] → [..., out]
    (through a bfloat16-packed weight, x and the bias are rounded to bf16 and the output, rounded
    to bf16 by oneDNN, comes back in x's dtype)."""
    if packed is None or not _enabled or x.dtype != torch.float32 or x.device.type != "cpu" or torch.is_autocast_enabled("cpu") or torch.is_grad_enabled():
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    if packed.dtype == torch.bfloat16:
        rows, bias = rows.to(torch.bfloat16), None if bias is None else bias.to(torch.bfloat16)
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "").to(x.dtype)
    return out.view(*x.shape[:-1], out.shape[-1])


class PackCache:
    """A packed copy of one weight for a module whose weights may change (a drafter being trained):
    rebuilt whenever the weight does (new storage, an in-place update, another dtype or device), and
    consulted only outside autograd. A weight created under `torch.inference_mode()` has no version
    counter, so it is never packed (plain `F.linear`). Copies and pickles start empty. `dtype`: the
    packed copy's (bfloat16: see the module docstring; None where the CPU lacks native bf16)."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype
        self._key: tuple | None = None
        self._packed: torch.Tensor | None = None

    def get(self, weight: torch.Tensor) -> torch.Tensor | None:
        if torch.is_grad_enabled() or weight.is_inference():
            return None  # an inference tensor keeps no version counter: an in-place update would go unseen
        key = (weight.data_ptr(), weight._version, weight.dtype, weight.device, tuple(weight.shape), _enabled, _bf16_enabled)
        if key != self._key:
            self._packed, self._key = pack(weight, self.dtype), key
        return self._packed

    def __getstate__(self) -> dict:
        return {"dtype": self.dtype, "_key": None, "_packed": None}


class PackedLinear(nn.Linear):
    """`nn.Linear` (same parameters, same state dict) whose inference on CPU in float32 goes through
    a packed copy of its weight (`PackCache`: repacked after each update); training is `F.linear`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._pack = PackCache()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype or torch.compiler.is_compiling():  # a traced graph stays plain aten
            return F.linear(x, self.weight, self.bias)
        return linear(x, self.weight, self.bias, self._pack.get(self.weight))
