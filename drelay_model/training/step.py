"""One training step of the drafter, alone or jointly with a trainable selector (DRelay §5, Eq. 4).

    L_t = Σ_{b,i} m_{b,i} [ w_slot(i) · (−log q_{b,i}(y_{b,i})) + α_t w_{b,i} ℓ^sel_{b,i} ] / Σ_{b,i} m_{b,i}

b runs over anchor blocks (B sequences × M anchors, flattened), i over the H slots. With soft labels
(`soft`: the target's top-k at each position), −log q(y) becomes −Σ_j p̃(t_j) log q(t_j) over the
target's own top-k, renormalised over the ids the draft vocabulary holds (`losses.soft_support_targets`).
The selector sees the block's pool (top-K of the drafter's softmax), the block's hidden states, the
last N verified target features before the anchor, and a prefix memory of the target-greedy labels
under a strict j < i mask; teacher tokens never enter Global Read. Gradients of the selector term flow
into the backbone through the slot states and pool log-probabilities (joint training).

`DraftTrainModule` holds drafter + selector so that one DDP wrapper syncs both.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from drelay_model.training import losses
from drelay_model.drafter.model import BlockDrafter, DraftBlock
from drelay_model.selectors.base import SelectorLossKnobs, SelectorTrainInputs
from drelay_model.selectors.drelay.objective import decision_metrics, decision_outcomes  # re-exported
from drelay_model.training.anchors import Blocks, PathPolicy, eligible_anchors, make_blocks, sample_uniform_anchors, scout_anchors
from drelay_model.training.head import DEFAULT_CHUNK_TOKENS, chunked_head
from drelay_model.training.schedules import slot_weights


class DraftTrainModule(nn.Module):
    """Drafter (+ optional trainable selector) as one module: what DDP wraps."""

    def __init__(self, drafter: BlockDrafter, selector: nn.Module | None = None) -> None:
        super().__init__()
        self.drafter = drafter
        self.selector = selector

    def forward(self, anchor_ids, anchor_pos, features, labels, valid, sel_inputs: SelectorTrainInputs | None = None,
                chunk_tokens=DEFAULT_CHUNK_TOKENS, soft: losses.SoftLabels | None = None, block_len=None):  # fmt: skip
        """anchors [B, M]; features [B, N, F]; labels, valid [B·M, H]; soft [B·M, H, k] the target's
        top-k per slot (soft support labels) or None → (HeadOutput over B·M blocks, the selector's own
        `SelectorTrainLoss` on the drafted blocks, or None).

        The vocabulary head runs in chunks (`chunked_head`): no [B, M, H, V] logits are ever built.
        `sel_inputs` carries labels, valid mask, history and loss knobs; the block and anchors are
        filled in here, so the selector's loss sees exactly the pool the head produced. `block_len`
        [B, M] drafts partial blocks (`BlockDrafter.block_hidden`): the drafter alone, since a
        selector's Global Read would read slots a partial block does not have.
        """
        d = self.drafter
        if block_len is not None and self.selector is not None and sel_inputs is not None:
            raise ValueError("partial blocks train the drafter alone, not a selector")
        hidden = d(anchor_ids, anchor_pos, features, block_len)[:, :, 1:]  # [B, M, H, D]
        B, M, H, D = hidden.shape
        head = chunked_head(d, hidden.reshape(B * M, H, D), labels, valid, chunk_tokens=chunk_tokens, soft=soft)
        sel = None
        if self.selector is not None and sel_inputs is not None:
            sel = self.selector.training_loss(sel_inputs.with_block(head.block, anchor_ids.reshape(-1)))
        return head, sel


@dataclass(frozen=True)
class StepConfig:
    """Per-step knobs; schedules (native fraction, α, β) are evaluated by the caller.

    micro_batches  split the step's sequences into this many forward/backward passes (gradient
                   accumulation; `training_step_backward`); the loss and gradients equal one pass.
    chunk_tokens   anchor slots per vocabulary-head chunk (peak head memory ∝ chunk_tokens · V).
    """

    anchors_per_seq: int
    native_fraction: float
    slot_decay: float | None = None  # None: Eq. 4's uniform support term; a float: DFlash's exp(-(i-1)/decay)
    # scout_policy "selector": the scout follows the selector's teacher-forced choices (the argmax for
    # a selector without `capabilities.teacher_forced`, or none); "native": the argmax path.
    # scout_restart: a chain that leaves the response restarts (m scout anchors per row).
    scout_policy: str = "selector"
    scout_restart: bool = True
    alpha: float = 1.0  # selector coefficient α_t
    progress: float = 1.0  # training progress ∈ [0, 1] (selectors whose loss mixes terms on a schedule)
    beta: float = 1.0  # credit blend β_t (0 = uniform weights)
    credit_floor: float = 0.1
    credit_cap: float = 4.0
    switches: losses.LossSwitches = losses.LossSwitches()
    micro_batches: int = 1
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    # The share of anchor blocks drafted as partial blocks of a random length L ∈ 1..H−1 (what a
    # cost-aware round drafts: `BlockDrafter.draft(slots=L)`), supervised on those L slots only.
    partial_blocks: float = 0.0


@dataclass
class StepOutput:
    loss: torch.Tensor
    metrics: dict[str, float]


def history_windows(features: torch.Tensor, anchors: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n verified features before each anchor, right-aligned (as the engine's VerifiedHistory).

    features [B, N, F], anchors [B, M] → (windows [B·M, n, F] in the features' dtype, mask [B·M, n]
    bool). Built as one gather from the features left-padded with n zero rows (window position j of
    anchor a reads padded row a + j = feature row a − n + j), so entries before the sequence start
    are zeros without a mask multiply, and nothing of size [B, M, N, F] is ever expanded.
    """
    B, N, F = features.shape
    j = torch.arange(n, device=anchors.device)
    padded = torch.nn.functional.pad(features, (0, 0, n, 0))  # [B, n + N, F]
    rows = torch.arange(B, device=anchors.device)[:, None, None]
    win = padded[rows, anchors[:, :, None] + j]  # [B, M, n, F]
    mask = anchors[:, :, None] - n + j >= 0
    return win.reshape(-1, n, F), mask.reshape(-1, n)


@dataclass(frozen=True)
class _Plan:
    """Anchors and blocks of the whole step (drawn once, before any micro-batch runs)."""

    anchors: torch.Tensor  # [B, M]
    blocks: Blocks  # labels/valid [B, M, H]
    denom: torch.Tensor  # [] Σ m over the whole step
    native_fraction: float  # realised share of scout anchors among the step's anchors (vs the schedule)
    soft: losses.SoftLabels | None = None  # [B, M, H, k] the target's top-k at each block slot
    block_len: torch.Tensor | None = None  # [B, M] slots drafted per block (partial blocks), or None: all H


def block_soft_labels(soft: losses.SoftLabels, anchors: torch.Tensor, H: int) -> losses.SoftLabels:
    """Per-position soft labels [B, N, k] → per block slot [B, M, H, k]: slot i of the block anchored at
    a reads position a + i (as `make_blocks` reads labels; positions past the end are clamped and
    masked by the blocks' `valid`)."""
    B, N, k = soft.ids.shape
    M = anchors.shape[1]
    pos = (anchors[:, :, None] + torch.arange(1, H + 1, device=anchors.device)).clamp(max=N - 1)  # [B, M, H]
    index = pos.reshape(B, M * H, 1).expand(-1, -1, k)
    return losses.SoftLabels(ids=soft.ids.gather(1, index).view(B, M, H, k), logp=soft.logp.gather(1, index).view(B, M, H, k))


def _plan(core: DraftTrainModule, input_ids, loss_mask, features, labels_src, cfg: StepConfig, generator, soft=None) -> _Plan:
    B, N = input_ids.shape
    drafter, selector = core.drafter, core.selector
    n_native = int(round(cfg.anchors_per_seq * cfg.native_fraction))
    anchors, ok = sample_uniform_anchors(eligible_anchors(loss_mask), cfg.anchors_per_seq - n_native, generator)
    n_scout = 0
    if n_native:
        with torch.no_grad():
            ctx = drafter.context_kv(features, torch.arange(N, device=input_ids.device)[None].expand(B, N))
        follows_selector = cfg.scout_policy == "selector" and selector is not None and selector.capabilities.teacher_forced
        policy = _selector_policy(selector, features) if follows_selector else None
        nat, nat_ok = scout_anchors(
            drafter, ctx, input_ids, labels_src, loss_mask, n_native, generator, policy=policy, restart=cfg.scout_restart
        )
        anchors, ok = torch.cat([anchors, nat], 1), torch.cat([ok, nat_ok], 1)
        n_scout = int(nat_ok.sum())
    H = drafter.config.num_slots
    blocks = make_blocks(labels_src, loss_mask, anchors, ok, H)
    block_len = None
    if cfg.partial_blocks > 0:
        block_len, blocks = partial_blocks(blocks, cfg.partial_blocks, H, generator)
    share = n_scout / max(int(ok.sum()), 1)
    soft_blocks = None if soft is None else block_soft_labels(soft, anchors, H)
    return _Plan(anchors=anchors, blocks=blocks, denom=blocks.valid.sum(), native_fraction=share, soft=soft_blocks,
                 block_len=block_len)  # fmt: skip


def partial_blocks(blocks: Blocks, share: float, H: int, generator) -> tuple[torch.Tensor, Blocks]:
    """Draw which blocks are drafted partially (each with probability `share`) and their lengths
    L ~ U{1, …, H−1} → (block_len [B, M]: L, or H for a whole block; the blocks with slots past L
    no longer valid)."""
    B, M = blocks.anchors.shape
    device = blocks.anchors.device
    partial = torch.rand(B, M, generator=generator).to(device) < share
    lengths = torch.randint(1, H, (B, M), generator=generator).to(device)
    block_len = torch.where(partial, lengths, torch.full_like(lengths, H))
    valid = blocks.valid & (torch.arange(H, device=device) < block_len[..., None])
    return block_len, Blocks(anchors=blocks.anchors, labels=blocks.labels, valid=valid)


def _micro_step(model, core: DraftTrainModule, input_ids, features, plan: _Plan, rows: slice, cfg: StepConfig) -> StepOutput:
    """Eq. 4 on the sequences `rows` of the step, divided by the whole step's Σ m:

    L = [Σ m·w_slot·(−log q(y)) + α_t Σ m·w·ℓ_sel] / Σ m,  the selector's term from its own loss.
    """
    drafter, selector = core.drafter, core.selector
    H = drafter.config.num_slots
    anchors, feats = plan.anchors[rows], features[rows]
    blocks = Blocks(anchors=anchors, labels=plan.blocks.labels[rows], valid=plan.blocks.valid[rows])
    labels, valid = blocks.labels.reshape(-1, H), blocks.valid.reshape(-1, H)  # [B·M, H]
    soft = None
    if plan.soft is not None:  # [B·M, H, k]
        soft = losses.SoftLabels(ids=plan.soft.ids[rows].flatten(0, 1), logp=plan.soft.logp[rows].flatten(0, 1))
    sel_inputs = None
    if selector is not None:
        history = hmask = None
        if selector.capabilities.history_len:
            history, hmask = history_windows(feats, anchors, selector.capabilities.history_len)
        knobs = SelectorLossKnobs(
            beta=cfg.beta,
            credit_floor=cfg.credit_floor,
            credit_cap=cfg.credit_cap,
            credit=cfg.switches.credit,
            progress=cfg.progress,
        )
        sel_inputs = SelectorTrainInputs(labels=labels, valid=valid, history=history, history_mask=hmask, knobs=knobs)
    anchor_ids = torch.gather(input_ids[rows], 1, anchors)
    block_len = None if plan.block_len is None else plan.block_len[rows]
    head, sel_out = model(anchor_ids, anchors, feats, labels, valid, sel_inputs, cfg.chunk_tokens, soft, block_len)
    w_slot = slot_weights(H, cfg.slot_decay).to(device=head.nll.device, dtype=head.nll.dtype)
    support = losses.SupportLoss(nll=head.nll * w_slot, counted=head.counted, out_of_vocab=head.out_of_vocab)
    metrics = _support_metrics(head.block.cand_ids[..., 0].view_as(blocks.labels), blocks, support)
    metrics["anchors/native_fraction"] = plan.native_fraction
    denom = plan.denom.clamp(min=1)
    if sel_out is None:
        loss = support.nll.sum() / denom if cfg.switches.support else head.block.hidden.sum() * 0.0
        metrics["loss/support"] = float(support.nll.detach().sum() / denom)
        return StepOutput(loss=loss, metrics=metrics)
    zero = head.nll.new_zeros(())
    sup = support.nll.sum() / denom if cfg.switches.support else zero
    slt = cfg.alpha * sel_out.weighted_sum / denom if cfg.switches.selector else zero
    loss = sup + slt
    local = valid.sum().clamp(min=1)  # this micro-batch's Σ m: its rates merge weighted by valid tokens
    coverage = ((head.block.cand_ids == labels[..., None]).any(-1) & valid).sum() / local
    metrics.update({
        "loss/support": sup.item(), "loss/selector": slt.item(), "loss/total": loss.item(),
        "pool/coverage": coverage.item(), "selector/alpha": cfg.alpha, "selector/credit_beta": cfg.beta,
        **sel_out.metrics,
    })  # fmt: skip
    return StepOutput(loss=loss, metrics=metrics)


def training_step(
    model: nn.Module,
    core: DraftTrainModule,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    features: torch.Tensor,
    cfg: StepConfig,
    generator: torch.Generator,
    *,
    label_ids: torch.Tensor | None = None,
    soft: losses.SoftLabels | None = None,
) -> StepOutput:
    """Anchors (uniform + scout) → blocks → Eq. 4 in one pass; the caller runs the backward.
    `model` may be the DDP wrapper of `core`.

    input_ids, loss_mask [B, N]; features [B, N, F]; label_ids [B, N] (default input_ids: the
    response is the target's own greedy output); soft [B, N, k] the target's top-k at each position
    (soft support labels, `losses.soft_support_targets`; None: hard labels). The selector term always
    uses the hard labels: decoding verifies against the target's greedy token. Ignores
    `cfg.micro_batches` (see `training_step_backward`).
    """
    labels_src = input_ids if label_ids is None else label_ids
    plan = _plan(core, input_ids, loss_mask, features, labels_src, cfg, generator, soft)
    return _micro_step(model, core, input_ids, features, plan, slice(None), cfg)


def training_step_backward(
    model,
    core,
    input_ids,
    loss_mask,
    features,
    cfg: StepConfig,
    generator,
    *,
    label_ids=None,
    soft: losses.SoftLabels | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> StepOutput:
    """`training_step` plus its backward, in `cfg.micro_batches` passes over disjoint sequences.

    `soft` as in `training_step`. `autocast_dtype` (e.g. torch.bfloat16): forwards run under autocast
    on the batch's device type (CPU or CUDA alike); backwards run outside it, as torch recommends.

    Anchors are drawn once for the whole step and every pass divides by the whole step's Σ m, so the
    accumulated gradients equal one pass's. DDP syncs gradients only on the last pass. Returns the
    detached total loss; metrics: losses and counts summed, rates averaged weighted by valid tokens.
    """
    labels_src = input_ids if label_ids is None else label_ids
    B = input_ids.shape[0]
    n = min(max(cfg.micro_batches, 1), B)
    bounds = [round(i * B / n) for i in range(n + 1)]
    amp = dict(device_type=input_ids.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None)
    with torch.autocast(**amp):
        plan = _plan(core, input_ids, loss_mask, features, labels_src, cfg, generator, soft)
    total, parts = None, []
    for i in range(n):
        rows = slice(bounds[i], bounds[i + 1])
        sync = i == n - 1 or not hasattr(model, "no_sync")
        with contextlib.nullcontext() if sync else model.no_sync():
            with torch.autocast(**amp):
                out = _micro_step(model, core, input_ids, features, plan, rows, cfg)
            out.loss.backward()
        total = out.loss.detach() if total is None else total + out.loss.detach()
        parts.append(out.metrics)
    return StepOutput(loss=total, metrics=_merge_metrics(parts))


_SUMMED = ("valid_tokens", "anchors", "draft_vocab/out_of_vocab")


def _merge_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    if len(parts) == 1:
        return parts[0]
    weights = [p["valid_tokens"] for p in parts]
    total_w = sum(weights) or 1.0
    out = {}
    for key in parts[0]:
        values = [p[key] for p in parts]
        if key.startswith("loss/") or key in _SUMMED:
            out[key] = sum(values)
        elif key in ("selector/alpha", "selector/credit_beta", "anchors/native_fraction"):
            out[key] = values[0]
        else:
            out[key] = sum(v * w for v, w in zip(values, weights)) / total_w
    return out


def _selector_policy(selector: nn.Module, features: torch.Tensor) -> PathPolicy:
    """The scout's path when it follows the selector: its own decisions under the teacher prefix
    (`Selector.teacher_forced_path`). Up to the first slot whose choice differs from the teacher token,
    the teacher prefix is exactly the prefix incremental selection writes, so the accepted count A
    equals what decoding accepts.
    """
    n = selector.capabilities.history_len

    def choose(block: DraftBlock, anchor_ids: torch.Tensor, anchor_pos: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        history = hmask = None
        if n:
            history, hmask = history_windows(features, anchor_pos[:, None], n)
        return selector.teacher_forced_path(block, anchor_ids=anchor_ids, labels=labels, history=history, history_mask=hmask)

    return choose


def _support_metrics(top1_ids, blocks, support) -> dict[str, float]:
    """top1_ids [B, M, H] the native (argmax) token of every slot, in target ids. `acc/accepted_run`:
    per block with a valid first slot, the leading slots whose argmax is the label (Σ_i Π_{j≤i}), the
    drafts a greedy round anchored there would accept; averaged over those blocks."""
    with torch.no_grad():
        top1 = (top1_ids == blocks.labels) & blocks.valid
        first = blocks.valid[:, :, 0].sum().clamp(min=1)
        run = torch.cumprod(top1.to(torch.int32), dim=-1).sum(-1)  # [B, M]
        return {
            "acc/slot1": float(top1[:, :, 0].sum() / first),
            "acc/accepted_run": float(run.sum() / first),
            "valid_tokens": float(blocks.valid.sum()),
            "anchors": float(blocks.valid[:, :, 0].sum()),
            "draft_vocab/out_of_vocab": float(support.out_of_vocab),
        }


def unwrap(module: nn.Module) -> nn.Module:
    """The module inside a DDP/FSDP wrapper (or the module itself)."""
    return getattr(module, "module", module)


__all__ = [
    "DraftBlock",
    "DraftTrainModule",
    "StepConfig",
    "StepOutput",
    "decision_metrics",
    "decision_outcomes",
    "history_windows",
    "training_step",
    "training_step_backward",
    "unwrap",
]
