"""The cost policy's decision: a bandit that picks, each round, how many drafts to verify.

Why it is built this way, and what it measures: docs/verification-length.md. A round consults the
policy once, before drafting (`CostPolicy.round` → a `PolicyRound`); that round's object then cuts
the drafted paths and hands the round's outcome and phase times back. The spec:

    E(L) = 1 + Σ_{i=1..L} Π_{j≤i} p_j                 expected tokens one row verifying L drafts commits
    t_b(L) = s_d·draft(b, L) + s_v·verify(b, 1 + L) + o_D    a round over b rows, its modelled time
                                                      (t_b(0) = s_v·verify(b, 1) + o_AR), from the
                                                      measured surface (`surface.py`)

    plan     before drafting: the (arm, L ≥ 1) maximising b·E(L) / t_b(L) at the arm's upper per-slot
             rates â⁺ (`rates.py`); it drafts when that beats an AR round (b / t_b(0)) by
             `min_gain`, else returns 0 (an AR round for the whole batch) except every `probe`-th
             round, which drafts anyway and verifies ≥ 1 draft (the interval doubles while probes
             lose, up to `max_probe`, and halves when the plan drafts)
    choose   after drafting, one length G ≤ L_plan for the batch: the G maximising Σ_rows E_r(G) /
             t_b(G) with drafting sunk, p_i = the calibrated confidence of each row's chosen candidate
             (running counts per q-bin). One length, not one per row: the verify forward's width is
             the longest row's, so a row verifying fewer than G drafts saves nothing and only
             commits less.
    observe  the verified outcomes update the round's arm and the calibration bins
    observe_times  measured phase times update s_d, s_v (one token / wider verifies) and o (AR / drafted);
             a verify width not yet observed borrows the other's s_v: the surface's error is mostly
             the machine's speed since it was measured, common to both, and while drafting wins no
             AR round runs to correct s_v for one token (it priced AR 1.4× too slow at batch 4,
             so drafting kept winning at τ 1.3 on GSM8K, 0.89× of AR's speed)

Arms: with a selector other than `native`, arm 0 runs the selector and arm 1 keeps the native path
without calling it. The settings (`PolicySettings`) are frozen; `CostPolicy` holds the running
state of one engine or continuous batcher; a `PolicyRound` is one round's plan and its feedback. Verifying fewer drafts never changes what is committed
(verification accepts only the target's own tokens), so every choice is lossless. The state is plain
Python numbers on the host. Shapes: B rows, H slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from drelay_model.decoding.cost_policy.rates import SlotRates
from drelay_model.decoding.cost_policy.surface import RoundCosts
from drelay_model.errors import DRelayError

__all__ = ["CostPolicy", "PolicyRound", "PolicySettings", "RoundTimes", "expected_committed"]

_BINS = 10  # calibration bins over q ∈ [0, 1]
_MAX_LOG_RATIO = math.log(2.0)  # one round's measured ÷ modelled counts as at most 2× the running scale


@dataclass(frozen=True)
class PolicySettings:
    """The policy's settings (decays are per round; κ are pseudo-counts)."""

    probe: int = 4  # while AR wins, a drafted round every `probe` rounds ...
    max_probe: int = 64  # ... the interval doubling while probes lose, up to this
    prior: float = 4.0  # pseudo-counts pulling a calibration bin towards its raw q
    time_decay: float = 0.9  # weight of the past in the running cost scales (≈ 10 rounds)
    rate_decay: float = 0.97  # per drafted round, on the per-slot counts (≈ 33 rounds)
    rate_prior: float = 16.0  # κ: pseudo-counts pulling â_i towards its long-run rate b_i
    base_prior: float = 2.0  # κ_b: pseudo-counts pulling a long-run rate b_i towards b_{i−1} (b_0 = ½)
    idle_decay: float = 0.99  # per round of another kind, on an arm's recent counts (≈ 100 rounds)
    base_decay: float = 0.98  # per drafted round of its arm, on the long-run counts (≈ 50 rounds)
    min_gain: float = 0.0  # a drafted round must be predicted this much faster per token than AR
    optimism: float = 1.0  # z: the plan prices drafting at â⁺ = â + z standard errors (0: at â)

    def __post_init__(self) -> None:
        for name in ("time_decay", "rate_decay", "idle_decay", "base_decay"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise DRelayError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not 0.0 <= self.min_gain < 1.0:
            raise DRelayError(f"min_gain must be in [0, 1), got {self.min_gain}")
        if not 1 <= self.probe <= self.max_probe:
            raise DRelayError(f"probe and max_probe must satisfy 1 ≤ probe ≤ max_probe, got {self.probe} and {self.max_probe}")
        for name in ("rate_prior", "base_prior"):
            if not getattr(self, name) > 0:
                raise DRelayError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0.0 <= self.optimism <= 4.0:
            raise DRelayError(f"optimism must be in [0, 4], got {self.optimism}")


def expected_committed(p: list[float]) -> list[float]:
    """E(L) for L = 0 .. H from one row's per-slot conditional acceptance p [H] → [H + 1]."""
    out, reach = [1.0], 1.0
    for pi in p:
        reach *= pi  # P(drafts 1..i all accepted)
        out.append(out[-1] + reach)
    return out


def _bin(q: float) -> int:
    """The calibration bin of a draft probability q ∈ [0, 1]."""
    return min(max(int(q * _BINS), 0), _BINS - 1)


def _best(e: list[float], t: list[float], start: int = 0) -> int:
    """argmax over L ≥ start of e[L] / t[L] (first maximum, like torch.argmax)."""
    return max(range(start, len(t)), key=lambda L: (e[L] / t[L], -L))


class CostPolicy:
    """The running state of the policy for one engine or continuous batcher; it persists across
    generate() calls (assign a fresh one to start cold).

    arms             [1 or 2] SlotRates: [0] rounds that run the selector, [1] the native arm
    arm              the arm of the round just planned
    bin_hits/seen    [BINS] accepted / verified drafts per q-bin (calibration)
    log_draft_scale  log s_d; log_verify_scale [2]: log s_v for 1 token and for ≥ 2 tokens
    other_ms         [2] o: the rest of an AR and of a drafted round
    """

    def __init__(
        self, costs: RoundCosts, num_slots: int, settings: PolicySettings = PolicySettings(), *, native_arm: bool = False
    ) -> None:
        if num_slots > costs.max_slots:
            raise DRelayError(f"costs cover {costs.max_slots} slots, the drafter has {num_slots}: re-measure them")
        self.costs, self.num_slots, self.settings = costs, num_slots, settings
        self.arms = [SlotRates(num_slots) for _ in range(1 + native_arm)]
        self.arm = 0
        self.bin_hits, self.bin_seen = [0.0] * _BINS, [0.0] * _BINS
        self.log_draft_scale = 0.0
        self.log_verify_scale = [0.0, 0.0]
        self._verify_seen = [False, False]  # whether rounds verifying one token / wider were timed
        self.other_ms = [0.0, 0.0]
        self._since_probe, self._interval = 0, settings.probe
        self._probing = False  # this round's plan is a probe

    # ---- the scaled cost surface -----------------------------------------------------------------
    def draft_ms(self, head_slots: int, decided: int | None = None, batch: int = 1) -> float:
        return math.exp(self.log_draft_scale) * self.costs.draft_ms(head_slots, decided, batch)

    def verify_ms(self, width: int, batch: int = 1) -> float:
        """Verifying `width` tokens (the anchor + width − 1 drafts) in each of `batch` rows."""
        return math.exp(self.log_verify_scale[width > 1]) * self.costs.verify(width, batch)

    def round_ms(self, head_slots: int, decided: int, width: int, batch: int = 1) -> float:
        """A whole round over `batch` rows: drafting (0 for an AR round) + verifying `width` tokens
        per row + the rest."""
        return self.draft_ms(head_slots, decided, batch) + self.verify_ms(width, batch) + self.other_ms[head_slots > 0]

    def slot_rates(self, arm: int = 0) -> list[float]:
        """[H] â_i of an arm. The selector's arm starts from the native arm's long-run rates, not
        from ½: it keeps the native path unless it repairs it."""
        s = self.settings
        prior = self.arms[1].base_rates(s.base_prior) if arm == 0 and len(self.arms) > 1 else None
        return self.arms[arm].rates(s.rate_prior, s.base_prior, prior)

    def upper_rates(self, arm: int = 0) -> list[float]:
        """[H] â⁺_i of an arm, what the plan prices drafting at (`rates.py`)."""
        return self.arms[arm].upper_rates(self.slot_rates(arm), self.settings.optimism)

    @property
    def use_selector(self) -> bool:
        """Whether the round just planned runs the selector (arm 0) or keeps the native path."""
        return self.arm == 0

    # ---- the round's one consultation ------------------------------------------------------------
    def round(self, *, rows: int, partial: bool = True) -> "PolicyRound":
        """Plan a round over `rows` rows (`plan`) → the round's `PolicyRound`: how many drafts it
        may verify, how many slots get an LM head (all H when the selector runs and reads the whole
        pool: partial=False), and whether the selector runs; it then cuts the drafted paths
        (`PolicyRound.cut`) and hands back what the round showed (`PolicyRound.learn`)."""
        L = self.plan(partial=partial, batch=rows)
        runs_selector = self.use_selector
        head = 0 if L == 0 else (L if partial or not runs_selector else self.num_slots)
        return PolicyRound(self, verify_slots=L, head_slots=head, runs_selector=runs_selector, rows=rows)

    # ---- before drafting -------------------------------------------------------------------------
    def plan(self, *, partial: bool = True, batch: int = 1) -> int:
        """How many slots to draft heads for this round over `batch` rows (0: an AR round); `arm`
        says which kind of drafted round. partial=False: the selector needs all H heads whatever is
        verified, so a round that runs it always pays for the full block. The rates are the arm's,
        shared by every row, so the batch's expected tokens are batch·E(L)."""
        H, s, b = self.num_slots, self.settings, batch
        t_ar = self.round_ms(0, 0, 1, b)
        options = []  # (tokens per ms, L, arm) of each arm's best L > 0
        for a in range(len(self.arms)):
            e = [b * x for x in expected_committed(self.upper_rates(a))]  # [H + 1]
            t = [t_ar] + [self.round_ms(L if partial or a == 1 else H, L if a == 0 else 0, L + 1, b) for L in range(1, H + 1)]
            best = _best(e, t, start=1)
            options.append((e[best] / t[best], best, a))
        rate, best, arm = max(options, key=lambda o: (o[0], o[2]))  # a tie goes to the cheaper native arm
        self._probing = False
        if rate >= (1.0 + s.min_gain) * b / t_ar:
            # drafting pays: probe sooner again once it stops (halving, not a reset, so that one
            # lucky probe on unpredictable text does not restart probing every few rounds)
            self._interval, self._since_probe = max(s.probe, self._interval // 2), 0
            self._use(arm)
            return best
        self._since_probe += 1
        self._use(None)
        if self._since_probe >= self._interval:  # probe: draft anyway to keep the estimates current
            self._since_probe, self._interval = 0, min(2 * self._interval, s.max_probe)
            self._probing = True  # a probe verifies at least one draft: its point is the evidence
            self.arm = arm  # the best arm: â⁺ already favours the one with less evidence
            return best
        return 0

    def _use(self, arm: int | None) -> None:
        """This round drafts with `arm` (None: an AR round); the other arms' recent counts fade."""
        for a, rates in enumerate(self.arms):
            if a != arm:
                rates.fade(self.settings.idle_decay)
        self.arm = 0 if arm is None else arm

    # ---- after drafting --------------------------------------------------------------------------
    def confidence(self, q: float) -> float:
        """Calibrated P(accept) for a chosen candidate's draft probability q ∈ [0, 1]."""
        b, prior = _bin(q), self.settings.prior
        return min(max((self.bin_hits[b] + prior * q) / (self.bin_seen[b] + prior), 0.0), 1.0)

    def choose(self, q: torch.Tensor, head_slots: int) -> torch.Tensor:
        """The batch's verification length G ≤ P from the chosen candidates' q [B, P] (the planned
        slots) → [B] int64, G in every row (on q's device). head_slots: the slots drafted with an LM
        head this round (≥ P), whose cost is already spent. G maximises Σ_rows E_r(G) / t_B(G): the
        verify forward is 1 + G tokens wide whatever each row would verify."""
        B, P = q.shape
        decided = P if self.arm == 0 else 0
        t = [self.round_ms(head_slots, decided, L + 1, B) for L in range(P + 1)]  # drafting is sunk: the same in every t
        start = int(self._probing and P > 0)
        e = [0.0] * (P + 1)  # Σ_rows E_r(L)
        for row in q.detach().tolist():
            for L, x in enumerate(expected_committed([self.confidence(v) for v in row])):
                e[L] += x
        return torch.full((B,), _best(e, t, start), dtype=torch.long, device=q.device)

    # ---- after verification ----------------------------------------------------------------------
    def observe(self, q: torch.Tensor, length: torch.Tensor, accepted: torch.Tensor) -> None:
        """Update the round's arm and the calibration bins from one round: q [B, G], length/accepted [B]."""
        outcomes = []
        for row, n_len, n_acc in zip(q.detach().tolist(), length.tolist(), accepted.tolist()):
            for i in range(min(n_len, n_acc + 1)):  # draft i was verified with i − 1 accepted
                b = _bin(row[i])
                hit = i < n_acc
                self.bin_seen[b] += 1.0
                self.bin_hits[b] += hit
                outcomes.append((i, hit))
        self.arms[self.arm].observe(outcomes, rate_decay=self.settings.rate_decay, base_decay=self.settings.base_decay)

    def observe_times(
        self,
        *,
        verify_width: int,
        verify_ms: float,
        head_slots: int = 0,
        decided: int = 0,
        draft_ms: float = 0.0,
        round_ms: float | None = None,
        batch: int = 1,
    ) -> None:
        """Update the running scales from one round's measured phase times (ms) over `batch` rows,
        each compared with the surface at that batch size: verification of `verify_width` tokens
        per row, for a drafted round (head_slots > 0) its drafting phase, and the whole round
        (`round_ms`: what is left after both phases is the round's other work o)."""
        decay = self.settings.time_decay

        def update(log_scale: float, measured: float, modelled: float) -> float:
            if not (measured > 0 and modelled > 0):
                return log_scale
            # clipped around the current estimate: a spike moves it little, a lasting change fully
            r = min(max(math.log(measured / modelled), log_scale - _MAX_LOG_RATIO), log_scale + _MAX_LOG_RATIO)
            return decay * log_scale + (1 - decay) * r

        w = min(verify_width, self.costs.max_slots + 1)
        kind = int(w > 1)
        self.log_verify_scale[kind] = update(self.log_verify_scale[kind], verify_ms, self.costs.verify(w, batch))
        self._verify_seen[kind] = True
        if not self._verify_seen[1 - kind]:  # the other width borrows this scale until it is timed itself
            self.log_verify_scale[1 - kind] = self.log_verify_scale[kind]
        if head_slots > 0:
            self.log_draft_scale = update(self.log_draft_scale, draft_ms, self.costs.draft_ms(head_slots, decided, batch))
        if round_ms is not None:
            rest = max(round_ms - verify_ms - (draft_ms if head_slots > 0 else 0.0), 0.0)
            kind = int(head_slots > 0)
            self.other_ms[kind] = decay * self.other_ms[kind] + (1 - decay) * min(rest, verify_ms)


@dataclass(frozen=True)
class RoundTimes:
    """One round's measured phases, in ms: `verify_ms` the target forward over `verify_width`
    tokens per row; `drafting_ms` from the start of drafting to the cut paths (the drafter's
    context catch-up, the block, the selector; 0 in an AR round), of which `catch_up_ms` was the
    catch-up; `total_ms` the whole round."""

    verify_width: int
    verify_ms: float
    total_ms: float
    drafting_ms: float = 0.0
    catch_up_ms: float = 0.0


@dataclass(frozen=True)
class PolicyRound:
    """One round as the policy planned it (`CostPolicy.round`).

    verify_slots   L: path tokens the round may verify (0: an AR round)
    head_slots     slots drafted with an LM head (L, or H when the selector runs and needs all of them)
    runs_selector  whether the round runs the selector (arm 0) or keeps the native path
    rows           the batch size it was planned for
    """

    policy: CostPolicy
    verify_slots: int
    head_slots: int
    runs_selector: bool
    rows: int

    @property
    def drafts(self) -> bool:
        return self.verify_slots > 0

    def cut(self, q: torch.Tensor) -> torch.Tensor:
        """The batch's verification length from the chosen candidates' q [B, L] → [B] int64
        (`CostPolicy.choose`)."""
        return self.policy.choose(q, self.head_slots)

    def learn(self, times: RoundTimes, q: torch.Tensor | None = None, length: torch.Tensor | None = None, accepted=None) -> None:
        """What the round showed: the verified outcomes of its cut paths (q [B, G], length and
        accepted [B]; None in an AR round) update the arm and calibration; its phase times update
        the cost scales. The policy prices a drafted round's own context extension (its surface's
        extend_ms), not the catch-up over the AR rounds before it: those positions are extended
        whenever drafting resumes, and charging them to this round would make drafting look dearer
        the longer it paused."""
        if q is not None:
            self.policy.observe(q, length, accepted)
        backlog = times.catch_up_ms - self.policy.costs.extend(self.rows) if self.drafts else 0.0
        self.policy.observe_times(
            verify_width=times.verify_width, verify_ms=times.verify_ms, head_slots=self.head_slots,
            decided=self.verify_slots if self.runs_selector else 0, draft_ms=times.drafting_ms - backlog,
            round_ms=times.total_ms - backlog, batch=self.rows,
        )  # fmt: skip
