"""Cost-aware verification length: how many path tokens a round verifies (0 = a plain AR step).

A round that verifies L drafts commits 1 + A tokens, A = the accepted drafts. With p_i = P(draft i is
accepted | drafts 1..i−1 were), its expectation is

    E(L) = 1 + Σ_{i=1..L} Π_{j≤i} p_j

and it costs t(L) = s_d·t_draft(L) + s_v·t_verify(1 + L) + o_D (t(0) = s_v·t_verify(1) + o_AR), with
the measured curve of `verify_costs.py` and running scales s_d, s_v (below). The policy picks the L
that maximises committed tokens per millisecond, E(L) / t(L), in two steps:

  plan    before drafting, from running per-slot acceptance rates â_i (no pool yet): L_plan, the
          number of slots whose LM head the drafter evaluates; 0 skips the drafter (an AR round).
          â_i: recent counts of drafts verified at slot i, shrunk towards their long-run rate
          (`slot_rates.py`): after a stretch of AR rounds â returns to what this engine saw over
          its last few dozen drafted rounds, not to an optimistic constant (which on chat text made
          every faded estimate look worth a losing drafted round).
          Arms: with a selector other than `native`, a drafted round either runs the selector
          (arm 0) or keeps the native path without calling it (arm 1: no select cost). Each arm
          has its own rates and cost curve, and the plan takes the best (arm, L); so a selector
          whose repairs do not pay for their cost on this machine is run only where they do. The
          selector's long-run rates start from the native arm's (not from ½): it keeps the native
          path unless it repairs it, and an arm with no evidence of its own looked 50% accepted.
          This is a bandit: an AR round learns nothing about the drafts it skipped, so an â that
          follows the last few rounds (a small κ) dips below break-even by chance
          (first-draft hits are Bernoulli(≈ 0.3)), the plan stops drafting, and only probes can
          lift it again; its rounds also draft exactly when â runs high, and deliver less than it
          promised. κ = 16 pseudo-counts make â follow the text over ~16 drafted rounds instead
          (the long-run rates keep κ_b = 2: `slot_rates.py`). And the plan prices drafting at an
          upper estimate â⁺ (`optimism`: z = 1 standard error of a first-slot rate seen N times,
          N the first drafts verified so far, UCB-style): a cold policy whose first few drafts
          miss keeps drafting until the text has shown what it accepts (the demo prompt opens with 2 hits in 16 rounds,
          then accepts 40%: with z = 0 the plan stayed AR through four repetitions of it).
          Replayed against recorded one-draft outcomes (`benchmarks/bench_policy.py`: the real
          policy, the cached cost curve) on held-out training-corpus prompts: S 1.041 (κ 2, 5%
          margin) → 1.067 (κ 16) → 1.088 (κ 16, z 1), always drafting 1.079 (docs/verification-length.md).
          `min_gain` (default 0) is a margin the best L > 0 must beat: it is taken only when its
          predicted rate is ≥ (1 + min_gain) × the AR round's.
          While AR wins, a drafted round still runs every `probe` rounds to keep â current (the
          interval doubles while probes keep losing, up to `max_probe`, and halves with each
          round the plan drafts on its own); a probe takes the best (arm, L) under â⁺ and
          verifies at least one draft, whatever `choose` says: its point is evidence.
  choose  after drafting, per row, from the pool: p_i = the calibrated confidence of the chosen
          candidate (its draft probability q, mapped through running acceptance counts per q-bin),
          L ≤ L_plan maximising E(L) / (t_sunk + s_v·t_verify(1 + L)) — drafting is already paid for.
  observe after verification, the accepted counts update the round's arm and the calibration bins;
          `observe_times` updates s_d and s_v, the running geometric means of measured ÷ modelled
          time of the drafting (draft + select + the round's own context extension: the catch-up over
          the AR rounds before it is left out, `engine.py`) and verification phases (s_v
          apart for one token, mostly AR rounds, and for wider verifies, which only drafted rounds
          measure, so the curve's slope is learned too and not only its level), and o, the
          running mean of the rest of an AR and of a drafted round (acceptance, cache crops, the
          policy itself: a drafted round's is larger, and the curve leaves it out). The
          curve is measured in isolation; in decoding the drafter runs with caches the target has
          just flushed, contexts grow and other processes come and go, and only the ratio s_d / s_v
          moves the argmax.

Verifying fewer tokens never changes what is committed: verification accepts only drafts that equal
the target's own tokens, whatever L is (tests cover every L, 0 included). The policy's own state is
plain Python numbers on the host: a round asks it a few dozen questions, each cheaper than a tensor op.

Shapes: B rows, H slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from drelay_model.decoding.slot_rates import SlotRates
from drelay_model.decoding.verify_costs import VerifyCosts, isotonic, measure_costs
from drelay_model.errors import DRelayError

__all__ = ["CostAwareLength", "VerifyCosts", "expected_committed", "isotonic", "measure_costs"]

_BINS = 10  # calibration bins over q ∈ [0, 1]
_MAX_LOG_RATIO = math.log(2.0)  # one round's measured ÷ modelled counts as at most 2× the running scale


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


@dataclass
class CostAwareLength:
    """The policy state of one engine or continuous batcher; it persists across generate() calls
    (assign a fresh one to start cold). See the module docstring."""

    costs: VerifyCosts
    num_slots: int
    probe: int = 4
    max_probe: int = 64
    prior: float = 4.0  # pseudo-counts pulling a calibration bin towards its raw q
    time_decay: float = 0.9  # weight of the past in the running cost scales (≈ 10 rounds)
    rate_decay: float = 0.97  # per drafted round, on the per-slot counts (≈ 33 rounds)
    rate_prior: float = 16.0  # κ: pseudo-counts pulling â_i towards its long-run rate b_i
    base_prior: float = 2.0  # κ_b: pseudo-counts pulling a long-run rate b_i towards b_{i−1} (b_0 = ½)
    idle_decay: float = 0.99  # per round of another kind, on an arm's recent counts (≈ 100 rounds)
    base_decay: float = 0.98  # per drafted round of its arm, on the long-run counts (≈ 50 rounds)
    min_gain: float = 0.0  # a drafted round must be predicted this much faster per token than AR
    optimism: float = 1.0  # z: the plan prices drafting at â⁺ = â + z standard errors (0: at â)
    native_arm: bool = False  # arm 1: drafted rounds that keep the native path without the selector
    arms: list[SlotRates] = field(init=False)  # [0]: rounds that run the selector; [1]: the native arm
    arm: int = 0  # the arm of the round just planned
    bin_hits: list[float] = field(init=False)  # [BINS] accepted drafts per q-bin
    bin_seen: list[float] = field(init=False)  # [BINS] verified drafts per q-bin
    log_draft_scale: float = 0.0  # log s_d
    log_verify_scale: list[float] = field(default_factory=lambda: [0.0, 0.0])  # log s_v: 1 token, ≥ 2 tokens
    other_ms: list[float] = field(default_factory=lambda: [0.0, 0.0])  # o: the rest of an AR / a drafted round
    _since_probe: int = 0
    _interval: int = 0
    _probing: bool = False  # this round's plan is a probe

    def __post_init__(self) -> None:
        if self.num_slots > self.costs.max_slots:
            raise DRelayError(f"costs cover {self.costs.max_slots} slots, the drafter has {self.num_slots}: re-measure them")
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
        self.arms = [SlotRates(self.num_slots) for _ in range(1 + self.native_arm)]
        self.bin_hits, self.bin_seen = [0.0] * _BINS, [0.0] * _BINS
        self._interval = self.probe

    # ---- the scaled cost curve -------------------------------------------------------------------
    def draft_ms(self, head_slots: int, decided: int | None = None) -> float:
        return math.exp(self.log_draft_scale) * self.costs.draft_ms(head_slots, decided)

    def verify_ms(self, width: int) -> float:
        """Verifying `width` tokens (the anchor + width − 1 drafts)."""
        return math.exp(self.log_verify_scale[width > 1]) * self.costs.verify_ms[width - 1]

    def round_ms(self, head_slots: int, decided: int, width: int) -> float:
        """A whole round: drafting (0 for an AR round) + verifying `width` tokens + the rest."""
        return self.draft_ms(head_slots, decided) + self.verify_ms(width) + self.other_ms[head_slots > 0]

    def slot_rates(self, arm: int = 0) -> list[float]:
        """[H] â_i of an arm (the module docstring). The selector's arm starts from the native arm's
        long-run rates, not from ½: it keeps the native path unless it repairs it."""
        prior = self.arms[1].base_rates(self.base_prior) if arm == 0 and len(self.arms) > 1 else None
        return self.arms[arm].rates(self.rate_prior, self.base_prior, prior)

    def upper_rates(self, arm: int = 0) -> list[float]:
        """[H] â⁺_i of an arm, what the plan prices drafting at (`slot_rates.py`)."""
        return self.arms[arm].upper_rates(self.slot_rates(arm), self.optimism)

    @property
    def use_selector(self) -> bool:
        """Whether the round just planned runs the selector (arm 0) or keeps the native path."""
        return self.arm == 0

    # ---- before drafting -------------------------------------------------------------------------
    def plan(self, *, partial: bool = True) -> int:
        """How many slots to draft heads for this round (0: an AR round); `arm` says which kind of
        drafted round. partial=False: the selector needs all H heads whatever is verified, so a
        round that runs it always pays for the full block."""
        H = self.num_slots
        t_ar = self.round_ms(0, 0, 1)
        options = []  # (tokens per ms, L, arm) of each arm's best L > 0
        for a in range(len(self.arms)):
            e = expected_committed(self.upper_rates(a))  # [H + 1]
            t = [t_ar] + [self.round_ms(L if partial or a == 1 else H, L if a == 0 else 0, L + 1) for L in range(1, H + 1)]
            best = _best(e, t, start=1)
            options.append((e[best] / t[best], best, a))
        rate, best, arm = max(options, key=lambda o: (o[0], o[2]))  # a tie goes to the cheaper native arm
        self._probing = False
        if rate >= (1.0 + self.min_gain) / t_ar:
            # drafting pays: probe sooner again once it stops (halving, not a reset, so that one
            # lucky probe on unpredictable text does not restart probing every few rounds)
            self._interval, self._since_probe = max(self.probe, self._interval // 2), 0
            self._use(arm)
            return best
        self._since_probe += 1
        self._use(None)
        if self._since_probe >= self._interval:  # probe: draft anyway to keep the estimates current
            self._since_probe, self._interval = 0, min(2 * self._interval, self.max_probe)
            self._probing = True  # a probe verifies at least one draft: its point is the evidence
            self.arm = arm  # the best arm: â⁺ already favours the one with less evidence
            return best
        return 0

    def _use(self, arm: int | None) -> None:
        """This round drafts with `arm` (None: an AR round); the other arms' recent counts fade."""
        for a, rates in enumerate(self.arms):
            if a != arm:
                rates.fade(self.idle_decay)
        self.arm = 0 if arm is None else arm

    # ---- after drafting --------------------------------------------------------------------------
    def confidence(self, q: float) -> float:
        """Calibrated P(accept) for a chosen candidate's draft probability q ∈ [0, 1]."""
        b = _bin(q)
        return min(max((self.bin_hits[b] + self.prior * q) / (self.bin_seen[b] + self.prior), 0.0), 1.0)

    def choose(self, q: torch.Tensor, head_slots: int) -> torch.Tensor:
        """Per-row verification length ≤ P from the chosen candidates' q [B, P] (the planned slots)
        → [B] int64 (on q's device). head_slots: the slots drafted with an LM head this round (≥ P),
        whose cost is already spent."""
        P = q.shape[1]
        decided = P if self.arm == 0 else 0
        t = [self.round_ms(head_slots, decided, L + 1) for L in range(P + 1)]  # drafting is sunk: the same in every t
        start = int(self._probing and P > 0)
        rows = [_best(expected_committed([self.confidence(v) for v in row]), t, start) for row in q.detach().tolist()]
        return torch.tensor(rows, dtype=torch.long, device=q.device)

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
        self.arms[self.arm].observe(outcomes, rate_decay=self.rate_decay, base_decay=self.base_decay)

    def observe_times(
        self, *, verify_width: int, verify_ms: float, head_slots: int = 0, decided: int = 0, draft_ms: float = 0.0, round_ms: float | None = None
    ) -> None:
        """Update the running scales from one round's measured phase times (ms): verification of
        `verify_width` tokens, for a drafted round (head_slots > 0) its drafting phase, and the
        whole round (`round_ms`: what is left after both phases is the round's other work o)."""

        def update(log_scale: float, measured: float, modelled: float) -> float:
            if not (measured > 0 and modelled > 0):
                return log_scale
            # clipped around the current estimate: a spike moves it little, a lasting change fully
            r = min(max(math.log(measured / modelled), log_scale - _MAX_LOG_RATIO), log_scale + _MAX_LOG_RATIO)
            return self.time_decay * log_scale + (1 - self.time_decay) * r

        w = min(verify_width, len(self.costs.verify_ms))
        self.log_verify_scale[w > 1] = update(self.log_verify_scale[w > 1], verify_ms, self.costs.verify_ms[w - 1])
        if head_slots > 0:
            self.log_draft_scale = update(self.log_draft_scale, draft_ms, self.costs.draft_ms(head_slots, decided))
        if round_ms is not None:
            rest = max(round_ms - verify_ms - (draft_ms if head_slots > 0 else 0.0), 0.0)
            kind = int(head_slots > 0)
            self.other_ms[kind] = self.time_decay * self.other_ms[kind] + (1 - self.time_decay) * min(rest, verify_ms)
