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

Small inputs can also go through int8 weights
(`pack(w, torch.int8)`, `Int8Weight`): one symmetric scale per output row, rounded to bf16 first so
that w ≈ s_r · q_r holds exactly for the kernel's scale, and bf16 activations into ATen's
weight-only int8 matmul (`_weight_int8pack_mm`). It reads a quarter of float32's bytes, rows stay
independent of each other, and it loops over rows, so it pays only up to `INT8_MAX_ROWS` rows. The
drafter uses it for the pool's ranking where bf16 is not native and, in a block of at most that many positions (the
cost-aware round's short drafts), for its layers' q/o/MLP weights (`PackedLinear(few_rows_int8=True)`):
measured on this 2-core AMD EPYC, draft(1) 13.4 → 8.6 ms, first-slot acceptance 0.334 → 0.335 on
1,100 positions of six benchmarks. Whole blocks (fixed length,
replay, training) and the context keys/values stay float32, so replay still agrees exactly with
real decoding at the fixed length. `DRELAY_INT8_DRAFT=0` (or `set_int8_enabled(False)`) turns it
off; `rank_dtype()` says which precision a pool is ranked in on this machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

BATCH_HINT = 16  # rows the packed layout is tuned for: H + 1 = 16 for the CPU default's verify
_enabled = os.environ.get("DRELAY_PACKED_LINEARS", "1") != "0"
_bf16_enabled = os.environ.get("DRELAY_BF16_POOL", "1") != "0"
_int8_enabled = os.environ.get("DRELAY_INT8_DRAFT", "1") != "0"
RANK = "rank"  # PackCache dtype: whatever `rank_dtype()` says at the time of packing
# ATen's int8 kernel reads the weight once per row: measured on the 16,384 × 576 draft head (2 cores,
# AVX2), 1.6 / 1.9 / 2.0 / 4.5 / 8.7 ms for 1 / 2 / 4 / 8 / 15 rows against float32 oneDNN's
# 2.9 / 3.2 / 3.7 / 4.5 / 5.7; above this many rows float32 is the faster ranking.
INT8_MAX_ROWS = 4


def set_enabled(on: bool) -> None:
    """Use packed weights where they exist (True) or always F.linear (False); for benchmarks."""
    global _enabled
    _enabled = bool(on)


def set_bf16_enabled(on: bool) -> None:
    """Allow bfloat16-packed weights (True, where the CPU runs bf16 natively) or never (False)."""
    global _bf16_enabled
    _bf16_enabled = bool(on)


def set_int8_enabled(on: bool) -> None:
    """Allow int8 weights for the drafter's short blocks (and its pool ranking where bf16 is not
    native) (True) or never (False)."""
    global _int8_enabled
    _int8_enabled = bool(on)


def available() -> bool:
    """oneDNN is built in and exposes the packed-linear ops."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def bf16_available() -> bool:
    """Packing in bfloat16 is on and this CPU runs it natively (emulated bf16 would be slower)."""
    return _enabled and _bf16_enabled and available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def int8_available() -> bool:
    """Int8 weights are on and this build has ATen's weight-only int8 matmul."""
    return _enabled and _int8_enabled and hasattr(torch.ops.aten, "_weight_int8pack_mm")


def rank_dtype() -> torch.dtype | None:
    """The precision a drafter's head ranks its vocabulary in here: bfloat16 where native, else int8
    weights, else None (float32, no ranking pass)."""
    if bf16_available():
        return torch.bfloat16
    return torch.int8 if int8_available() else None


def draft_precisions() -> tuple[str, ...]:
    """What a drafter runs in below float32 here, for keys of what depends on it (cached cost
    curves): its pool's ranking ("rank-bfloat16" / "rank-int8") and int8 short blocks ("int8-blocks")."""
    rank = rank_dtype()
    return (() if rank is None else (f"rank-{str(rank).removeprefix('torch.')}",)) + (
        ("int8-blocks",) if int8_available() else ()
    )


def int8_pays(rows: int) -> bool:
    """Whether an input of `rows` rows is faster through int8 weights than through float32 oneDNN."""
    return rows <= INT8_MAX_ROWS


def ranks_faster(packed: "torch.Tensor | Int8Weight | None", rows: int) -> bool:
    """Whether ranking `rows` rows through `packed` beats the float32 head (None: never)."""
    return packed is not None and (not isinstance(packed, Int8Weight) or int8_pays(rows))


@dataclass(frozen=True)
class Int8Weight:
    """A weight [out, in] as int8 rows and one bf16 scale per row: w[r] ≈ scales[r] · q[r]."""

    q: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out] bfloat16

    @staticmethod
    def quantize(weight: torch.Tensor) -> "Int8Weight":
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1).clamp_min(1e-12) / 127).to(torch.bfloat16)  # the kernel's exact scale
        q = torch.round(w / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
        return Int8Weight(q=q.contiguous(), scales=scales)


def pack(weight: torch.Tensor, dtype: torch.dtype | str = torch.float32) -> torch.Tensor | Int8Weight | None:
    """A packed copy in `dtype` (float32, bfloat16, int8, or RANK: `rank_dtype()`) of a float32 CPU
    weight [out, in], or None where packing does not apply."""
    if not _enabled or not available() or weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    if dtype == RANK:
        dtype = rank_dtype()
        if dtype is None:
            return None
    if dtype == torch.int8:
        return Int8Weight.quantize(weight) if int8_available() else None
    if dtype == torch.bfloat16 and not bf16_available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype), BATCH_HINT)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | Int8Weight | None
) -> torch.Tensor:
    """F.linear(x, weight, bias), through the packed weight when it applies. x [..., in] → [..., out]
    (through a bfloat16-packed or int8 weight, x is rounded to bf16 and the output, rounded to
    bf16 by the kernel, comes back in x's dtype; a bfloat16-packed weight's bias is rounded too, an
    int8 weight's is added in x's dtype)."""
    if (
        packed is None
        or not _enabled
        or x.dtype != torch.float32
        or x.device.type != "cpu"
        or torch.is_autocast_enabled("cpu")
        or torch.is_grad_enabled()
    ):
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    if isinstance(packed, Int8Weight):
        out = torch.ops.aten._weight_int8pack_mm(rows.to(torch.bfloat16), packed.q, packed.scales).to(x.dtype)
        out = out if bias is None else out + bias
        return out.view(*x.shape[:-1], out.shape[-1])
    if packed.dtype == torch.bfloat16:
        rows, bias = rows.to(torch.bfloat16), None if bias is None else bias.to(torch.bfloat16)
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "").to(x.dtype)
    return out.view(*x.shape[:-1], out.shape[-1])


class PackCache:
    """A packed copy of one weight for a module whose weights may change (a drafter being trained):
    rebuilt whenever the weight does (new storage, an in-place update, another dtype or device), and
    consulted only outside autograd. A weight created under `torch.inference_mode()` has no version
    counter, so it is never packed (plain `F.linear`). Copies and pickles start empty. `dtype`: the
    packed copy's (float32, bfloat16, int8 or RANK: see the module docstring; `get` is None where
    this CPU cannot run it)."""

    def __init__(self, dtype: torch.dtype | str = torch.float32) -> None:
        self.dtype = dtype
        self._key: tuple | None = None
        self._packed: torch.Tensor | None = None

    def get(self, weight: torch.Tensor) -> torch.Tensor | None:
        if torch.compiler.is_compiling() or torch.is_grad_enabled() or weight.is_inference():
            return None  # a traced graph stays plain aten; an inference tensor keeps no version counter
        key = (
            weight.data_ptr(),
            weight._version,
            weight.dtype,
            weight.device,
            tuple(weight.shape),
            _enabled,
            _bf16_enabled,
            _int8_enabled,
        )
        if key != self._key:
            self._packed, self._key = pack(weight, self.dtype), key
        return self._packed

    def __getstate__(self) -> dict:
        return {"dtype": self.dtype, "_key": None, "_packed": None}


class PackedLinear(nn.Linear):
    """`nn.Linear` (same parameters, same state dict) whose inference on CPU in float32 goes through
    a packed copy of its weight (`PackCache`: repacked after each update); training is `F.linear`.
    `few_rows_int8`: inputs of at most INT8_MAX_ROWS rows go through int8 weights where
    `int8_available()` (the drafter's short blocks; see `BlockDrafter.draft`)."""

    def __init__(self, *args, few_rows_int8: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._pack = PackCache()
        self._int8 = PackCache(torch.int8) if few_rows_int8 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype or torch.compiler.is_compiling():  # a traced graph stays plain aten
            return F.linear(x, self.weight, self.bias)
        if self._int8 is not None and int8_pays(x[..., 0].numel()):
            packed = self._int8.get(self.weight)
            if packed is not None:
                return linear(x, self.weight, self.bias, packed)
        return linear(x, self.weight, self.bias, self._pack.get(self.weight))
