"""DRelay's training objective (§5, Appendix B) as pure tensor math: no modules, no state.

Shapes: B anchor blocks, H slots, K pool size, V (draft) vocabulary. `mask` [B, H] bool is m_{b,i}:
True on supervised positions (it excludes anchors, padding and non-contiguous response positions).
Labels y are target-vocabulary ids (the target's greedy tokens).

    support   −log q_{b,i}(y_{b,i})  dense CE over the drafter's (draft) vocabulary, or with soft labels
              −Σ_j p̃_{b,i}(t_j) log q_{b,i}(t_j) over the target's renormalised top-k (`soft_support_targets`)
    selector  Eq. 3: BCE(g_i, 0) if y_i = v_i0;  BCE(g_i, 1) − log r_{i,k_i} if covered at k_i > 0;
              0 on a pool miss
    credit    Eq. 5: v_i = c_i Π_{j<i} p̄_j (1 + Σ_{t>i} Π_{j=i+1..t} p̄_j),
              p̄_j = c_j (1 + stopgrad p_j) / 2,  p_j = p_act(k_j) when covered else 0
    weights   per block: normalise v to mean one with a uniform floor and a cap (`normalize_credit`;
              a block with no credit, its first slot missed, keeps the floor alone),
              then blend progressively w_t = (1 − β_t)·1 + β_t·w
    joint     Eq. 4: L_t = Σ m [−log q(y) + α_t w ℓ_sel] / Σ m

Ablations ("No support loss", "No selector loss", "Uniform repair weights") are `LossSwitches`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SupportLoss:
    """nll [B, H] float32 −log q(y) where counted, else 0; counted [B, H] bool = mask ∧ (y inside the
    draft vocabulary); out_of_vocab [] int64 = supervised labels the draft vocabulary cannot express
    (ignored for CE; they still count in Eq. 4's denominator)."""

    nll: torch.Tensor
    counted: torch.Tensor
    out_of_vocab: torch.Tensor


def support_ce(
    logits: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor,
    *,
    draft_to_target: torch.Tensor | None = None,
) -> SupportLoss:
    """Dense support CE over the (draft) vocabulary.

    Args:
        logits           [B, H, V] drafter logits (V = draft vocabulary size, or the target's).
        labels           [B, H] int64 target-vocabulary ids.
        mask             [B, H] bool supervised positions.
        draft_to_target  [V] int64 sorted ascending (`build_draft_vocab`), or None for the full vocabulary.
    Returns:
        SupportLoss (nll [B, H] float32, counted [B, H] bool, out_of_vocab [] int64).
    """
    B, H, V = logits.shape
    assert labels.shape == (B, H) and mask.shape == (B, H), "labels and mask must be [B, H]"
    if draft_to_target is None:
        draft, inside = labels, torch.ones_like(mask)
    else:
        pos = torch.searchsorted(draft_to_target, labels).clamp(max=V - 1)  # [B, H]
        inside = draft_to_target[pos] == labels
        draft = pos
    counted = mask & inside
    target = torch.where(counted, draft, torch.full_like(draft, -100))
    nll = F.cross_entropy(logits.reshape(B * H, V).float(), target.reshape(-1), ignore_index=-100, reduction="none")
    return SupportLoss(nll=nll.view(B, H), counted=counted, out_of_vocab=(mask & ~inside).sum())


@dataclass(frozen=True)
class SoftLabels:
    """The target's own next-token distribution, truncated to its top k: ids [..., k] int64 target ids,
    logp [..., k] float32 their log-probabilities log p(t_j | x_<p) under the target, in descending
    order (−inf marks "no entry": unsupervised positions). Leading shapes follow the labels'."""

    ids: torch.Tensor
    logp: torch.Tensor

    def to(self, device) -> "SoftLabels":
        return SoftLabels(ids=self.ids.to(device), logp=self.logp.to(device))


@dataclass(frozen=True)
class SupportTargets:
    """What the support term gathers from log q at each (block, slot): ids [R, H, k] int64 draft-vocabulary
    ids (any valid id where the weight is 0), weight [R, H, k] float32 (rows sum to 1 where counted, else
    0), counted [R, H] bool, out_of_vocab [] int64 supervised slots with nothing draftable."""

    ids: torch.Tensor
    weight: torch.Tensor
    counted: torch.Tensor
    out_of_vocab: torch.Tensor


def to_draft_ids(ids: torch.Tensor, draft_to_target: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Target ids [...] → (draft ids [...] int64, inside [...] bool: the id has a drafter logit)."""
    if draft_to_target is None:
        return ids, torch.ones_like(ids, dtype=torch.bool)
    pos = torch.searchsorted(draft_to_target, ids).clamp(max=draft_to_target.shape[0] - 1)
    return pos, draft_to_target[pos] == ids


def soft_support_targets(soft: SoftLabels, mask: torch.Tensor, *, draft_to_target: torch.Tensor | None = None) -> SupportTargets:
    """Soft support targets: the target's top-k distribution, restricted to what the drafter can draft.

    At a supervised slot the target's top k are (t_j, ℓ_j = log p(t_j | x_<p)), j = 1..k. Let
    S = {j : t_j in the draft vocabulary, ℓ_j > −inf}. The support term's target distribution is

        p̃(t_j) = exp(ℓ_j) / Σ_{j'∈S} exp(ℓ_j')    for j ∈ S,   0 otherwise,

    the target's softmax restricted to its top k, with the ids the draft vocabulary cannot express
    dropped (they have no drafter logit), renormalised. The loss is the cross-entropy
    CE(p̃, q) = −Σ_j p̃(t_j) log q(t_j) = KL(p̃ ‖ q) + H(p̃) (same gradient as the KL). With k = 1,
    p̃ is one-hot at the target's argmax: the hard-label CE. A slot with S empty is not counted
    (as an out-of-vocabulary hard label); it stays in Eq. 4's denominator.

    Args:
        soft [R, H, k]; mask [R, H] bool supervised slots; draft_to_target as in `support_ce`.
    Returns:
        SupportTargets.
    """
    R, H, k = soft.ids.shape
    assert soft.logp.shape == (R, H, k) and mask.shape == (R, H), "soft labels must be [R, H, k], mask [R, H]"
    draft, inside = to_draft_ids(soft.ids, draft_to_target)
    keep = inside & torch.isfinite(soft.logp) & mask[..., None]  # [R, H, k]
    logits = torch.where(keep, soft.logp.float(), torch.full_like(soft.logp, float("-inf"), dtype=torch.float32))
    counted = keep.any(dim=-1)  # [R, H]
    weight = torch.where(counted[..., None], logits.softmax(dim=-1), torch.zeros_like(logits))  # no NaN rows
    return SupportTargets(ids=torch.where(keep, draft, 0), weight=weight, counted=counted, out_of_vocab=(mask & ~counted).sum())


def hard_support_targets(
    labels: torch.Tensor, mask: torch.Tensor, *, draft_to_target: torch.Tensor | None = None
) -> SupportTargets:
    """The hard-label support targets: one entry (k = 1) of weight 1 at the label y where it is draftable."""
    draft, inside = to_draft_ids(labels, draft_to_target)
    counted = mask & inside
    return SupportTargets(
        ids=torch.where(counted, draft, 0)[..., None],
        weight=counted.float()[..., None],
        counted=counted,
        out_of_vocab=(mask & ~inside).sum(),
    )


def soft_support_ce(
    logits: torch.Tensor, soft: SoftLabels, mask: torch.Tensor, *, draft_to_target: torch.Tensor | None = None
) -> SupportLoss:
    """Dense support CE against soft labels: nll [B, H] = −Σ_j p̃(t_j) log q(t_j) (`soft_support_targets`).
    logits [B, H, V] drafter logits; soft [B, H, k]; mask [B, H] bool. → SupportLoss."""
    tgt = soft_support_targets(soft, mask, draft_to_target=draft_to_target)
    logq = logits.float().log_softmax(dim=-1)  # [B, H, V]
    nll = -(tgt.weight * logq.gather(-1, tgt.ids)).sum(dim=-1)
    return SupportLoss(nll=nll, counted=tgt.counted, out_of_vocab=tgt.out_of_vocab)


def log_p_act(gate: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
    """Eq. 2 in log space. gate [B, H], rank [B, H, K] → [B, H, K]:
    log p_act(0) = log σ(−g);  log p_act(k) = log σ(g) + log softmax_{k>0}(S)_k for k > 0."""
    log_r = rank[..., 1:].log_softmax(dim=-1)
    return torch.cat([F.logsigmoid(-gate)[..., None], F.logsigmoid(gate)[..., None] + log_r], dim=-1)


@dataclass(frozen=True)
class SelectorLoss:
    """per_token [B, H] ℓ_sel (0 on misses and unsupervised positions); covered [B, H] bool c_i
    (False where unsupervised); index [B, H] int64 pool index k_i (−1 where not covered);
    p_label [B, H] p_act(k_i) (0 where not covered; differentiable, `prefix_credit` detaches it)."""

    per_token: torch.Tensor
    covered: torch.Tensor
    index: torch.Tensor
    p_label: torch.Tensor


def selector_loss(
    gate: torch.Tensor, rank: torch.Tensor, cand_ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor
) -> SelectorLoss:
    """Eq. 3 per token.

    Args:
        gate [B, H] gate logits g; rank [B, H, K] rank scores S; cand_ids [B, H, K] int64 pool ids
        (target vocabulary); labels [B, H] int64 target tokens; mask [B, H] bool.
    Returns:
        SelectorLoss.
    """
    B, H, K = cand_ids.shape
    hit = cand_ids == labels[..., None]  # [B, H, K]
    covered = hit.any(dim=-1) & mask
    index = torch.where(covered, hit.long().argmax(dim=-1), torch.full_like(labels, -1))
    k = index.clamp(min=0)
    keep = covered & (index == 0)  # covered base-correct → KEEP
    repair = covered & (index > 0)  # covered alternative → REPAIR with its identity
    bce_keep = F.binary_cross_entropy_with_logits(gate, torch.zeros_like(gate), reduction="none")
    bce_repair = F.binary_cross_entropy_with_logits(gate, torch.ones_like(gate), reduction="none")
    log_r = rank[..., 1:].log_softmax(dim=-1)  # [B, H, K−1]
    log_r_k = log_r.gather(-1, (k - 1).clamp(min=0)[..., None])[..., 0]  # log r_{i,k_i} (valid where k > 0)
    zero = torch.zeros_like(gate)
    per_token = torch.where(keep, bce_keep, torch.where(repair, bce_repair - log_r_k, zero))
    log_p = log_p_act(gate, rank).gather(-1, k[..., None])[..., 0]  # [B, H]
    p_label = torch.where(covered, log_p.exp(), zero)
    return SelectorLoss(per_token=per_token, covered=covered, index=index, p_label=p_label)


def prefix_credit(p: torch.Tensor, covered: torch.Tensor) -> torch.Tensor:
    """Raw prefix-value credit v (Eq. 5), no gradient.

        p̄_j = c_j (1 + p_j) / 2                           (p detached: stopgrad)
        v_i = c_i · Π_{j<i} p̄_j · (1 + Σ_{t=i+1}^{H} Π_{j=i+1}^{t} p̄_j)
              reach          continuation value

    Args:
        p [B, H] p_act(k_i) (0 where not covered); covered [B, H] bool c_i (already masked).
    Returns:
        v [B, H] float32 ≥ 0.
    """
    B, H = p.shape
    c = covered.to(torch.float32)
    p_bar = c * (1.0 + p.detach().float()) / 2.0  # [B, H]
    reach = torch.cumprod(torch.cat([torch.ones_like(p_bar[:, :1]), p_bar[:, :-1]], dim=1), dim=1)  # Π_{j<i}
    # run[b, i, t] = Π_{j=i+1}^{t} p̄_j for t > i: cumulative products of p̄ with 1 at positions j ≤ i.
    after = torch.triu(torch.ones(H, H, dtype=torch.bool, device=p.device), diagonal=1)  # [i, j]: j > i
    run = torch.where(after, p_bar[:, None, :], torch.ones_like(p_bar)[:, None, :]).cumprod(dim=-1)
    continuation = 1.0 + (run * after).sum(dim=-1)  # [B, H]
    return c * reach * continuation


def normalize_credit(v: torch.Tensor, valid: torch.Tensor, *, floor: float = 0.1, cap: float = 4.0) -> torch.Tensor:
    """Per block: mean one over the valid positions, a uniform floor, the largest weight capped.

    On a block's n valid positions (n ≥ 1) with credit Σ_j v_j > 0:
      1. floor:  ŵ_i = f + (1 − f) · n v_i / Σ_j v_j;  mean ŵ = 1, ŵ ≥ f.
      2. cap by water-filling: w_i = min(C, a ŵ_i) with the unique a ≥ 1 such that mean w = 1.
         The excess mass above the cap is handed back to the uncapped positions in proportion to ŵ,
         so mean w = 1, max w ≤ C and min w ≥ f hold together (a ≥ 1 keeps the floor).
    A block whose credit is all zero (Σ_j v_j = 0 with n ≥ 1) has no prefix value to normalise to
    mean one: that happens exactly when its first slot misses the pool (c_1 = 0, so v_1 = 0 and every
    later reach Π_{j<i} p̄_j = 0; a covered first slot has v_1 ≥ 1), and decoding never reaches its
    later decisions. Its credit share n v_i / Σ v is taken as 0, so only the uniform floor remains:
    w_i = f on every valid position (mean f, not one). Invalid positions get weight 0; a block
    without valid positions is all zeros.

    Args:
        v [B, H] raw credit ≥ 0; valid [B, H] bool (supervised and covered: where ℓ_sel is defined).
        floor f ∈ (0, 1] (1 = uniform); cap C ≥ 1.
    Returns:
        w [B, H] float32.
    """
    if not 0.0 < floor <= 1.0 or cap < 1.0:
        raise ValueError(f"need 0 < floor ≤ 1 and cap ≥ 1, got floor={floor}, cap={cap}")
    B, H = v.shape
    vf = torch.where(valid, v.detach().float(), torch.zeros_like(v, dtype=torch.float32))
    n = valid.sum(dim=1, keepdim=True).float()  # [B, 1]
    total = vf.sum(dim=1, keepdim=True)
    credited = total > 0  # [B, 1]; False: nothing to gain in this block, the floor alone
    share = torch.where(credited, vf * n / total.clamp(min=1e-30), torch.zeros_like(vf))
    w_hat = torch.where(valid, floor + (1.0 - floor) * share, torch.zeros_like(vf))  # [B, H], Σ = n where credited
    # Water-filling: with the m largest ŵ capped, a_m = (n − m C) / (n − Σ_{top m} ŵ). The solution
    # is the smallest m < n whose (m+1)-th largest ŵ stays under the cap: a_m ŵ_(m+1) ≤ C.
    srt = w_hat.sort(dim=1, descending=True).values  # [B, H]
    top = torch.cat([torch.zeros_like(srt[:, :1]), srt.cumsum(dim=1)[:, :-1]], dim=1)  # Σ of the m largest, m = 0..H−1
    m = torch.arange(H, device=v.device, dtype=torch.float32)[None, :]
    a = (n - m * cap) / (n - top).clamp(min=1e-30)  # [B, H] candidate scale for each m
    ok = (m < n) & (a * srt <= cap * (1 + 1e-6))
    first = ok.float().argmax(dim=1, keepdim=True)  # smallest valid m (always exists for n ≥ 1, f > 0)
    scale = torch.where(credited, a.gather(1, first).clamp(min=1.0), torch.ones_like(total))  # floor blocks: w = f ≤ C
    w = torch.minimum(w_hat * scale, torch.full_like(w_hat, cap))
    return torch.where(valid & (n > 0), w, torch.zeros_like(w))


def blend_weights(w: torch.Tensor, valid: torch.Tensor, beta: float) -> torch.Tensor:
    """Progressive replacement of uniform weights: (1 − β)·1 + β·w on valid positions, 0 elsewhere."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    return torch.where(valid, (1.0 - beta) + beta * w, torch.zeros_like(w))


@dataclass(frozen=True)
class LossSwitches:
    """Ablations (Table 4): support=False "No support loss", selector=False "No selector loss",
    credit=False "Uniform repair weights"."""

    support: bool = True
    selector: bool = True
    credit: bool = True


@dataclass(frozen=True)
class JointLoss:
    """loss [] the objective of Eq. 4; support, selector [] its two terms (each already divided by the
    common denominator, selector including α and w); tokens [] Σ m; weights [B, H] the repair
    weights used; coverage [] fraction of supervised tokens whose label is in the pool."""

    loss: torch.Tensor
    support: torch.Tensor
    selector: torch.Tensor
    tokens: torch.Tensor
    weights: torch.Tensor
    coverage: torch.Tensor


def repair_weights(
    sel: SelectorLoss, *, beta: float, floor: float = 0.1, cap: float = 4.0, uniform: bool = False
) -> torch.Tensor:
    """Prefix-value weights w_t for the selector term: Eq. 5 credit, normalised per block, blended
    with uniform weights by β (`uniform=True`: the "Uniform repair weights" ablation). → [B, H]."""
    valid = sel.covered
    if uniform:
        return valid.float()
    w = normalize_credit(prefix_credit(sel.p_label, sel.covered), valid, floor=floor, cap=cap)
    return blend_weights(w, valid, beta)


def joint_loss(
    support: SupportLoss,
    sel: SelectorLoss,
    mask: torch.Tensor,
    *,
    alpha: float,
    beta: float,
    floor: float = 0.1,
    cap: float = 4.0,
    switches: LossSwitches = LossSwitches(),
    denom: torch.Tensor | None = None,
) -> JointLoss:
    """Eq. 4: L_t = Σ_{b,i} m_{b,i} [−log q_{b,i}(y_{b,i}) + α_t w_{b,i} ℓ^sel_{b,i}] / Σ_{b,i} m_{b,i}.

    Args:
        support  `support_ce` output; sel `selector_loss` output; mask [B, H] bool m.
        alpha    selector coefficient α_t; beta credit blend β_t (see `repair_weights`).
        denom    Σ m over the whole step when this call sees one micro-batch of it (default: Σ mask),
                 so that micro-batch losses add up to the full step's loss.
    Returns:
        JointLoss.
    """
    m = mask.float()
    tokens = m.sum()
    denom = (tokens if denom is None else denom.float()).clamp(min=1.0)
    weights = repair_weights(sel, beta=beta, floor=floor, cap=cap, uniform=not switches.credit)
    zero = m.new_zeros(())
    sup = (support.nll * support.counted).sum() / denom if switches.support else zero
    slt = alpha * (m * weights * sel.per_token).sum() / denom if switches.selector else zero
    coverage = (sel.covered.float().sum() / denom).detach()
    return JointLoss(loss=sup + slt, support=sup, selector=slt, tokens=tokens, weights=weights, coverage=coverage)
