"""Per-GPU memory and FLOPs of one joint training step, from shapes alone (no tensors allocated).

Components (bytes, per worker):
    target      frozen target weights + the fused q/k/v and gate/up copies of `TargetModel`
    trainable   drafter + selector parameters, gradients and AdamW moments: 16 B per parameter
                (fp32 master weights 4 + grads 4 + two moments 8; autocast keeps params fp32)
    frozen      drafter buffers that are copies (the draft-vocabulary head rows), and with a frozen
                drafter its weights (4 B per parameter; they train nothing)
    ddp         DistributedDataParallel's gradient buckets with more than one worker: a second copy
                of the trainable gradients (4 B per parameter), allocated when DDP wraps the module
                and kept for the run (`gradient_as_bucket_view` off, torch's default)
    features    the batch's context features [B, N, F] (fp32, as FeatureSource returns them)
    activations the larger of two stages, per micro-batch of b = ⌈B / micro_batches⌉ sequences:
      feature forward  KV cache + layer transients + the prefill attention scores of the target
      joint step       what the drafter, vocabulary head and selector save for backward, plus the
                       largest transient (masked block attention scores, or one head chunk)

Notation: N sequence length (= drafter context C), M anchors/sequence, S = H + 1 block size,
Q = M·S block queries, Ck = C + Q keys, a = compute bytes (2 under bf16 autocast, else 4).

Attention is priced for the path the code takes on the planned device (`drelay_model/attention.py`,
`attention_path`): `sdpa-gqa` (CPU: torch's flash kernel with the bool mask and grouped heads) keeps
the nkv-head k/v and a 1-byte mask; `sdpa-expanded` (CUDA: k/v repeated to nh heads, one additive
bias per forward, the memory-efficient kernel) keeps nh-head k/v and an a-byte bias; `math` (the
fallback) keeps fp32 [Q, Ck] scores per head and layer. No fused path keeps scores. Coefficients
(tensors kept per token) were counted from the code and checked against measured peaks at CPU scale,
per path (tests/model/test_memory_plan.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from drelay_model.attention import MATH, PATHS, SDPA_EXPANDED, SDPA_GQA, attention_path

GiB = 1024**3


@dataclass(frozen=True)
class TargetShape:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied_embeddings: bool = False
    bytes_per_param: int = 2

    def params(self) -> int:
        D, hd = self.hidden, self.head_dim
        attn = D * hd * (2 * self.heads + 2 * self.kv_heads)
        per_layer = attn + 3 * D * self.intermediate + 2 * D + 2 * hd
        return self.vocab * D * (1 if self.tied_embeddings else 2) + self.layers * per_layer + D

    def fused_copies(self) -> int:
        """q/k/v and gate/up concatenated once more by TargetModel (parameters)."""
        return self.layers * self.hidden * (self.head_dim * (self.heads + 2 * self.kv_heads) + 2 * self.intermediate)


@dataclass(frozen=True)
class DrafterShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    feature_layers: int
    block_size: int = 16
    top_k: int = 16
    draft_vocab: int | None = None

    def params(self) -> int:
        D, hd = self.hidden, self.head_dim
        per_layer = D * hd * (2 * self.heads + 2 * self.kv_heads) + 3 * D * self.intermediate + 2 * D + 2 * hd
        return self.layers * per_layer + self.feature_layers * D * D + 3 * D


@dataclass(frozen=True)
class SelectorShape:
    params: int  # counted from the module (count_selector_params)
    d: int = 256
    heads: int = 4
    read_dim: int = 128
    compact_dim: int = 64
    history_len: int = 64


@dataclass(frozen=True)
class StepShape:
    seqs_per_step: int  # per worker
    seq_len: int
    anchors_per_seq: int
    micro_batches: int = 1
    chunk_tokens: int = 2048
    bf16: bool = True


@dataclass
class MemoryPlan:
    components: dict[str, int]  # bytes
    activation_stages: dict[str, int]  # bytes, the larger one is counted
    flops_per_step: float
    attention: str = SDPA_GQA  # the attention path priced (drelay_model/attention.py)
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.components.values())


def _check_path(attention: str) -> str:
    if attention not in PATHS:
        raise ValueError(f"attention path must be one of {PATHS}, got {attention!r}")
    return attention


def _attention_bytes(attention: str, a: int, b: int, nh: int, nkv: int, hd: int, Q: int, Ck: int) -> tuple[int, int]:
    """(bytes one layer's attention keeps for backward beyond q, nkv-head k/v, out and logsumexp;
    bytes of the mask built once per forward with its builders) for b rows of Q queries, Ck keys.

    Per layer: sdpa-gqa keeps the mask SDPA converts from bool to the compute dtype on every call
    (a B per pair); sdpa-expanded keeps k/v of nh heads instead of nkv; math keeps those and one
    fp32 score tensor per head. Once: bool mask + builders ~3 B per pair (sdpa-gqa, math), or the
    a-byte bias + 2 B of bool builders (sdpa-expanded)."""
    if attention == SDPA_GQA:
        return a * b * Q * Ck, 3 * b * Q * Ck
    expanded = 2 * a * b * (nh - nkv) * Ck * hd
    if attention == SDPA_EXPANDED:
        return expanded, (a + 2) * b * Q * Ck
    return expanded + 4 * b * nh * Q * Ck, 3 * b * Q * Ck


def _drafter_step_activations(
    t: TargetShape, d: DrafterShape, s: SelectorShape | None, st: StepShape, attention: str | bool = SDPA_GQA
) -> dict[str, int]:
    """Activation stages of the joint step. `attention` is a path name (drelay_model/attention.py);
    True / False mean a fused path without expansion / the math fallback."""
    if isinstance(attention, bool):
        attention = SDPA_GQA if attention else MATH
    attention = _check_path(attention)
    b = math.ceil(st.seqs_per_step / st.micro_batches)
    a = 2 if st.bf16 else 4
    H, S, M, C = d.block_size - 1, d.block_size, st.anchors_per_seq, st.seq_len
    Q, Ck, V = M * S, C + M * S, d.draft_vocab or t.vocab
    D, I, nh, nkv, hd = d.hidden, d.intermediate, d.heads, d.kv_heads, d.head_dim
    F = d.feature_layers * t.hidden
    attn_kept, mask = _attention_bytes(attention, a, b, nh, nkv, hd, Q, Ck)
    scores = 4 * b * nh * Q * Ck if attention == MATH else 0  # one [b, nh, Q, Ck] fp32 (math path)
    # Saved per token of each drafter layer, in units of width: block tokens ~9 D + 3 I + 3 nh·hd,
    # context tokens ~3 D + 6 nkv·hd; plus what the attention path keeps per layer; the mask once.
    per_layer = a * (b * Q * (9 * D + 3 * I + 3 * nh * hd) + b * C * (3 * D + 6 * nkv * hd)) + attn_kept
    drafter = d.layers * per_layer + a * b * C * F + mask
    rows = min(st.chunk_tokens, b * M * H)
    head_chunk = 3 * 4 * rows * V  # one chunk's fp32 logits / log-softmax / their gradient
    head_saved = b * M * H * (a * D + 16 * d.top_k)
    out = {"drafter": drafter, "head": head_saved, "transient": max(2 * scores, head_chunk)}
    # The selector's activations live between the head's forward chunks and its backward chunks
    # (the backward reaches the head after the selector's saved tensors are freed): the step's
    # peak is drafter + head + max(one head chunk, selector), not their sum.
    if s is not None:
        K, n, r = d.top_k, s.history_len, s.read_dim
        windows = b * M * n * (4 * F + 2 * a * s.d)
        candidates = b * M * H * (K + 1) * a * (4 * s.d + s.compact_dim + 2 * r)
        reads = b * M * s.heads * 4 * 4 * (H * K) ** 2  # Global Read's [HK, HK] per head: bias, scores, +null, softmax
        out["selector"] = windows + candidates + reads
    return out


def step_peak(stages: dict[str, int]) -> int:
    """Peak of the joint step from its stages (see `_drafter_step_activations`)."""
    return stages["drafter"] + stages["head"] + max(stages["transient"], stages.get("selector", 0))


def _feature_forward(t: TargetShape, st: StepShape, feature_layers: int, attention: str) -> int:
    """The target's no-grad forward over the whole batch: KV cache, one layer's transients, the
    causal mask in the path's form (+ nh-head k/v copies on the expanded and math paths; scores,
    their masked copy and softmax in fp32 on the math path), and the features kept."""
    b, N, a = st.seqs_per_step, st.seq_len, t.bytes_per_param
    cache = 2 * t.layers * b * t.kv_heads * N * t.head_dim * a
    layer = b * N * a * (4 * t.intermediate + 3 * t.head_dim * (t.heads + 2 * t.kv_heads) + 6 * t.hidden)
    kv_copies = 0 if attention == SDPA_GQA else 2 * b * t.heads * N * t.head_dim * a
    mask = (a + 2) * b * N * N  # bool causal mask + builders, and its a-byte form (bias, or SDPA's per-call copy)
    scores = 3 * 4 * b * t.heads * N * N if attention == MATH else 0
    return cache + layer + kv_copies + mask + scores + 2 * b * N * feature_layers * t.hidden * a


def estimate(
    t: TargetShape,
    d: DrafterShape,
    s: SelectorShape | None,
    st: StepShape,
    *,
    attention: str = SDPA_GQA,
    ddp: bool = False,
    frozen_drafter: bool = False,
) -> MemoryPlan:
    """Peak memory per worker by component and the FLOPs of one training step, with attention on
    `attention` (`drelay_model.attention.attention_path(device)` for the device that will run);
    `ddp`: the module is wrapped in DistributedDataParallel (more than one worker); `frozen_drafter`
    (`drafter.freeze`): the drafter's parameters are weights only (4 B each), no gradients or moments."""
    attention = _check_path(attention)
    trainable = (0 if frozen_drafter else d.params()) + (s.params if s is not None else 0)
    F = d.feature_layers * t.hidden
    stages = _drafter_step_activations(t, d, s, st, attention)
    step = step_peak(stages)
    feat = _feature_forward(t, st, d.feature_layers, attention)
    components = {
        "target weights": (t.params() + t.fused_copies()) * t.bytes_per_param,
        "trainable params, grads, AdamW": 16 * trainable,
        "frozen drafter weights, buffers": (d.draft_vocab or 0) * d.hidden * t.bytes_per_param
        + (4 * d.params() if frozen_drafter else 0),
        "DDP gradient buckets": 4 * trainable if ddp else 0,
        "features": 4 * st.seqs_per_step * st.seq_len * F,
        "activations": max(step, feat),
    }
    return MemoryPlan(
        components=components,
        activation_stages={"feature forward": feat, **{f"step: {k}": v for k, v in stages.items()}},
        flops_per_step=flops_per_step(t, d, st, trainable),
        attention=attention,
    )


def predicted_peak_bytes(
    t: TargetShape, d: DrafterShape, s: SelectorShape | None, st: StepShape, *, device: str = "cuda", ddp: bool = False
) -> int:
    """Predicted peak bytes per worker of a training run on `device` ("cuda", "cpu"), with
    attention priced on the path the code takes there (`drelay_model.attention.attention_path`)."""
    return estimate(t, d, s, st, attention=attention_path(device), ddp=ddp).total


def flops_per_step(t: TargetShape, d: DrafterShape, st: StepShape, trainable: int) -> float:
    """2·params·tokens for the target forward; 6·params·tokens for the drafter (fwd + bwd) over the
    block queries; the vocabulary head 2·D·V per slot forward, ×2 more for its recomputation and
    backward; attention 4·Q·Ck·hd·heads per drafter layer (×3 with backward)."""
    B, N, M = st.seqs_per_step, st.seq_len, st.anchors_per_seq
    Q, Ck, V = M * d.block_size, N + M * d.block_size, d.draft_vocab or t.vocab
    target = 2.0 * (t.params() - t.vocab * t.hidden) * B * N
    drafter = 6.0 * trainable * B * Q + 3 * 4.0 * B * Q * Ck * d.head_dim * d.heads * d.layers
    head = 3 * 2.0 * d.hidden * V * B * M * (d.block_size - 1) + 2.0 * d.hidden * V * B * M * (d.block_size - 1)
    return target + drafter + head


ATTENTION_NOTES = {
    SDPA_GQA: "SDPA with the bool mask and grouped heads: torch's CPU flash kernel",
    SDPA_EXPANDED: "k/v expanded to all heads, additive bias, SDPA's memory-efficient kernel",
    MATH: "explicit [Q, Ck] scores: the math fallback",
}


def format_plan(plan: MemoryPlan, gpu_memory_gib: float | None = None) -> str:
    lines = [f"  {name:<40} {v / GiB:8.2f} GiB" for name, v in plan.components.items()]
    lines.append(f"  {'total (peak per GPU)':<40} {plan.total / GiB:8.2f} GiB")
    lines.append("  activations by stage (the larger stage counts):")
    lines += [f"    {name:<38} {v / GiB:8.2f} GiB" for name, v in plan.activation_stages.items()]
    lines.append(f"  FLOPs per step (per GPU): {plan.flops_per_step:.3e}")
    lines.append(f"  attention path: {plan.attention} ({ATTENTION_NOTES[plan.attention]})")
    if gpu_memory_gib is not None:
        fits = plan.total <= gpu_memory_gib * GiB
        margin = 1 - plan.total / (gpu_memory_gib * GiB)
        lines.append(f"  fits in {gpu_memory_gib:g} GiB: {'yes' if fits else 'NO'} (margin {margin:.0%})")
    return "\n".join(lines)


def count_selector_params(name: str, config: dict, *, drafter_shape: DrafterShape, target: TargetShape) -> int:
    """Parameters of a registry selector, counted by building it on the meta device (no memory)."""
    import torch

    from drelay_model.selectors import default_registry

    class _Sizes:  # what `Selector.build` reads from a drafter
        pass

    with torch.device("meta"):
        fake = _Sizes()
        fake.config = _Sizes()
        fake.config.num_slots, fake.config.top_k = drafter_shape.block_size - 1, drafter_shape.top_k
        fake.config.hidden_size = drafter_shape.hidden
        fake.config.target_layer_ids = tuple(range(drafter_shape.feature_layers))
        fake.embed_weight = torch.empty(target.vocab, target.hidden)
        selector = default_registry().create(name, drafter=fake, config=config)
    return sum(p.numel() for p in selector.parameters())
