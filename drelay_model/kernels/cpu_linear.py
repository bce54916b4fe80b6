"""Pre-packed oneDNN linears for inference on CPU: the frozen target, the drafter, the DRelay selector.

Verification runs the target on 1 + L tokens at once. On CPU, PyTorch's float32 `F.linear` takes a
matrix-vector path for one token and a GEMM for two or more that re-packs the weight on every call:
on this 2-core machine SmolLM2's LM head (49,152 × 576) took 12 ms for one row, 27 ms for two and
31 ms for sixteen, so verifying even one drafted token cost almost twice an AR step. oneDNN's linear
on a weight packed once (`torch.ops.mkldnn._reorder_linear_weight`) reads the weight as it is:
8 / 9 / 12.6 ms for 1 / 2 / 16 rows. It also computes a row the same whatever rows share the call
(max |Δ| = 0 between a row alone and in a batch of 16, against 6e-5 for the eager pair), with one
exception found on an AVX-512 EPYC: a call of ONE row through a weight of more than 1,024 inputs (the
target's down projection, the DRelay selector's history projection) is rounded differently from
the same row in a call of 2 to 1,024 rows. Code that stores rows computed in one call and reuses
them as rows of another (the selector's caches) therefore pads its few-row calls to
`INVARIANT_ROWS` rows (`rows_invariant`). AR's step and verification still agree only to rounding
(SDPA's CPU kernel, too, rounds a query differently by the number of queries beside it): on that
machine the target's logits for the same position differ by at most 1.4e-4 between AR and
verification blocks of 2 to 16 tokens, and no greedy token differed in 2,304 positions × 4 block
sizes (`analysis/ar_verify_agreement.py`; docs/benchmarks.md).

Inference only (no autograd through the packed op), float32 CPU tensors only; everything else (bf16
autocast in training's feature forward, CUDA) falls back to `F.linear`, so packing never changes
what runs off this path. `CpuKernels(packed=False)` turns it off for the model given it;
`benchmarks/bench_packed.py` measures each phase of a round with it on and off.

A weight can also be packed in bfloat16 (`pack(w, torch.bfloat16)`) where oneDNN runs bf16 natively
(AVX512-BF16 / AMX): it reads half the bytes, and its input and output are rounded to bf16. The
drafter uses it only to rank its draft vocabulary (`BlockDrafter.pool`): its 16,384 × 576 head is
the largest weight a draft reads, and in decoding it comes from memory every round (the target
streams ~540 MB per step through a 32 MB L3). The pool's members then get float32 logits, so the
drafter's hidden states, and replay's agreement with real decoding, stay exact. Rounding the
drafter's layers as well saved 0.3 ms a draft but made replay diverge from real decoding (an
ulp of float32 difference upstream becomes a bf16 rounding step). `CpuKernels(bf16_pool=False)`
ranks in int8 or float32.

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
real decoding at the fixed length. `CpuKernels(int8_draft=False)` turns it off.

The three choices are settings, `CpuKernels`, owned by the model that packs: a target is given them
(`load_target(..., cpu_kernels=)`; default `CpuKernels.from_env()`: DRELAY_PACKED_LINEARS,
DRELAY_BF16_POOL, DRELAY_INT8_DRAFT, each 0 or 1, default 1), a drafter takes its target's unless
given its own, and a selector built for a drafter takes the drafter's (`use_cpu_kernels`).
`CpuKernels.active(device, dtype)` says what of them takes effect for weights there on this machine;
its `cache_tag()` keys what depends on it (cached cost curves) and `describe()` is one line for
`drelay generate --verbose`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

BATCH_HINT = 16  # rows the packed layout is tuned for: H + 1 = 16 for the CPU default's verify
# A packed call of at least this many rows computes each row as a call of any other size from 2 rows
# up does (checked on an AVX-512 EPYC against 1,024-row calls, inputs of 256 to 2,048); the packed
# layout is tuned for it.
INVARIANT_ROWS = BATCH_HINT
RANK = "rank"  # PackCache dtype: whatever the owner's `CpuKernels.rank_dtype()` says at the time of packing
# ATen's int8 kernel reads the weight once per row: measured on the 16,384 × 576 draft head (2 cores,
# AVX2), 1.6 / 1.9 / 2.0 / 4.5 / 8.7 ms for 1 / 2 / 4 / 8 / 15 rows against float32 oneDNN's
# 2.9 / 3.2 / 3.7 / 4.5 / 5.7; above this many rows float32 is the faster ranking.
INT8_MAX_ROWS = 4


def available() -> bool:
    """oneDNN is built in and exposes the packed-linear ops."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def bf16_native() -> bool:
    """This CPU runs oneDNN's bfloat16 linear natively (emulated bf16 would be slower than float32)."""
    return available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def int8_kernel() -> bool:
    """This build has ATen's weight-only int8 matmul."""
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


@dataclass(frozen=True)
class CpuKernels:
    """Which CPU kernels a model's inference may use (float32 CPU weights only; see the module docstring).

    packed      oneDNN-packed float32 linears (off: `F.linear` everywhere, and the two below are off).
    bf16_pool   the drafter ranks its pool through a bfloat16 head where the CPU runs bf16 natively.
    int8_draft  int8 weights for the drafter's short blocks, and for its pool ranking where bf16 is
                not native.
    """

    packed: bool = True
    bf16_pool: bool = True
    int8_draft: bool = True

    ENV = {"packed": "DRELAY_PACKED_LINEARS", "bf16_pool": "DRELAY_BF16_POOL", "int8_draft": "DRELAY_INT8_DRAFT"}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "CpuKernels":
        """The settings named by DRELAY_PACKED_LINEARS, DRELAY_BF16_POOL and DRELAY_INT8_DRAFT (0 or 1
        each; unset: 1). Another value is a DRelayError naming the variable."""
        environ = os.environ if environ is None else environ
        values = {}
        for field, name in cls.ENV.items():
            raw = environ.get(name, "1").strip()
            if raw not in ("0", "1"):
                from drelay_model.errors import DRelayError

                raise DRelayError(f"{name} must be 0 or 1, got {raw!r}")
            values[field] = raw == "1"
        return cls(**values)

    def active(self, device: torch.device | str, dtype: torch.dtype) -> "CpuKernels":
        """What of these settings takes effect for `dtype` weights on `device` on this machine: all
        off but on CPU in float32 with oneDNN; bf16_pool only where bf16 is native; int8_draft only
        where the int8 kernel exists."""
        if not (self.packed and torch.device(device).type == "cpu" and dtype == torch.float32 and available()):
            return CpuKernels(packed=False, bf16_pool=False, int8_draft=False)
        return CpuKernels(packed=True, bf16_pool=self.bf16_pool and bf16_native(), int8_draft=self.int8_draft and int8_kernel())

    def rank_dtype(self) -> torch.dtype | None:
        """The precision a drafter's head ranks its vocabulary in under these (active) settings:
        bfloat16, else int8 weights, else None (float32, no ranking pass)."""
        if self.packed and self.bf16_pool:
            return torch.bfloat16
        return torch.int8 if self.packed and self.int8_draft else None

    def cache_tag(self) -> str:
        """These (active) settings as a file-name suffix for what depends on them (cached cost
        curves): "-packed", then what a drafter runs below float32: its pool's ranking
        ("-rank-bfloat16" / "-rank-int8") and int8 short blocks ("-int8-blocks"); "" when off."""
        if not self.packed:
            return ""
        rank = self.rank_dtype()
        tags = ["packed"] + ([f"rank-{str(rank).removeprefix('torch.')}"] if rank is not None else [])
        return "".join(f"-{t}" for t in tags + (["int8-blocks"] if self.int8_draft else []))

    def describe(self, device: torch.device | str, dtype: torch.dtype) -> str:
        """One line: the settings and what of them takes effect for `dtype` weights on `device`."""
        asked = " ".join(f"{name}={int(getattr(self, field))}" for field, name in self.ENV.items())
        on = self.active(device, dtype)
        if not on.packed:
            why = "packing off" if not self.packed else "packing applies only to float32 CPU weights with oneDNN"
            return f"cpu kernels: {asked} → F.linear throughout ({why})"
        rank = on.rank_dtype()
        pool = f"pool ranked in {str(rank).removeprefix('torch.')}" if rank is not None else "pool in float32"
        blocks = "int8 short draft blocks" if on.int8_draft else "float32 draft blocks"
        return f"cpu kernels: {asked} → packed float32 linears, {pool}, {blocks}"


def use_cpu_kernels(module: nn.Module, kernels: CpuKernels) -> None:
    """Hand a model's settings to every `PackedLinear` it holds (the model's constructor, or the
    registry for a selector it builds for a drafter)."""
    for m in module.modules():
        if isinstance(m, PackedLinear):
            m.cpu_kernels = kernels


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


def pack(weight: torch.Tensor, kernels: CpuKernels, dtype: torch.dtype | str = torch.float32) -> torch.Tensor | Int8Weight | None:
    """A packed copy in `dtype` (float32, bfloat16, int8, or RANK: `kernels.rank_dtype()`) of a
    float32 CPU weight [out, in] under its owner's `kernels`, or None where packing does not apply."""
    on = kernels.active(weight.device, weight.dtype)
    if not on.packed:
        return None
    if dtype == RANK:
        dtype = on.rank_dtype()
        if dtype is None:
            return None
    if dtype == torch.int8:
        return Int8Weight.quantize(weight) if on.int8_draft else None
    if dtype == torch.bfloat16 and not on.bf16_pool:
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


def rows_invariant(fn, x: torch.Tensor):
    """fn(x) for a row-wise map `fn` of x [M, F] → [M, …] (or a tuple of such), called on at least
    INVARIANT_ROWS rows (zero rows appended, their outputs dropped), so that each row's output equals,
    bit for bit, what a call with many more rows gives it."""
    M = x.shape[0]
    if M >= INVARIANT_ROWS:
        return fn(x)
    out = fn(torch.cat([x, x.new_zeros(INVARIANT_ROWS - M, *x.shape[1:])]))
    return tuple(t[:M] for t in out) if isinstance(out, tuple) else out[:M]


class PackCache:
    """A packed copy of one weight for a module whose weights may change (a drafter being trained):
    rebuilt whenever the weight does (new storage, an in-place update, another dtype or device) or
    its owner's settings do, and consulted only outside autograd. A weight created under
    `torch.inference_mode()` has no version counter, so it is never packed (plain `F.linear`).
    Copies and pickles start empty. `dtype`: the packed copy's (float32, bfloat16, int8 or RANK: see
    the module docstring; `get` is None where the settings or this CPU do not run it)."""

    def __init__(self, dtype: torch.dtype | str = torch.float32) -> None:
        self.dtype = dtype
        self._key: tuple | None = None
        self._packed: torch.Tensor | None = None

    def get(self, weight: torch.Tensor, kernels: CpuKernels) -> torch.Tensor | Int8Weight | None:
        """The packed copy of `weight` under its owner's `kernels` (None where it does not apply)."""
        if torch.compiler.is_compiling() or torch.is_grad_enabled() or weight.is_inference():
            return None  # a traced graph stays plain aten; an inference tensor keeps no version counter
        key = (weight.data_ptr(), weight._version, weight.dtype, weight.device, tuple(weight.shape), kernels)
        if key != self._key:
            self._packed, self._key = pack(weight, kernels, self.dtype), key
        return self._packed

    def __getstate__(self) -> dict:
        return {"dtype": self.dtype, "_key": None, "_packed": None}


class PackedLinear(nn.Linear):
    """`nn.Linear` (same parameters, same state dict) whose inference on CPU in float32 goes through
    a packed copy of its weight (`PackCache`: repacked after each update) under `cpu_kernels`, the
    settings of the model that holds it (`use_cpu_kernels`; default: every kernel allowed);
    training is `F.linear`. `few_rows_int8`: inputs of at most INT8_MAX_ROWS rows go through int8
    weights where the settings allow them (the drafter's short blocks; see `BlockDrafter.draft`)."""

    def __init__(self, *args, few_rows_int8: bool = False, cpu_kernels: CpuKernels = CpuKernels(), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cpu_kernels = cpu_kernels
        self._pack = PackCache()
        self._int8 = PackCache(torch.int8) if few_rows_int8 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype or torch.compiler.is_compiling():  # a traced graph stays plain aten
            return F.linear(x, self.weight, self.bias)
        if self._int8 is not None and int8_pays(x[..., 0].numel()):
            packed = self._int8.get(self.weight, self.cpu_kernels)
            if packed is not None:
                return linear(x, self.weight, self.bias, packed)
        return linear(x, self.weight, self.bias, self._pack.get(self.weight, self.cpu_kernels))
