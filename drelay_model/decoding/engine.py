"""The decoding engine: batched rounds of draft → select → verify → commit.

    prefill:  target(prompt) → KV cache, context features, first token x₀ (the first anchor)
    round:    plan          L = how many path tokens to verify (the policy; H without one; 0 = AR)
              draft         block  = drafter(anchor, context)            pool [B, H, K]
              select        path   = selector(block)                     [B, H] (≤ L tokens per row)
              verify        logits = target([anchor, path])              one forward over 1 + L tokens
                            n, x   = accept(path, logits)                longest matching prefix, target's token
              commit        keep path[:n]; crop the target's cache to the accepted length; anchor ← x

Autoregressive decoding (no drafter) is the same loop with an empty path, so AR and speculative
timings come from one code path. With measured `costs`, each round consults the cost policy once,
when it plans (`cost_policy/`: the number of path tokens that maximises expected tokens per second;
0 = an AR round); that round's plan then cuts the paths and learns from the round.

One loop drives the phases: the continuous batcher (`batcher.py`) admits requests (`prefill`), runs
`round` over its rows with each row's own acceptance rule and path sampler, and commits per row
(EOS, stop, budget, statistics). `generate` is a static batch submitted to it at once. The engine
knows nothing about tokenization: token ids in and out.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from drelay_model.decoding.batch_state import BatchState
from drelay_model.decoding.batcher import ContinuousBatcher
from drelay_model.decoding.generation import GenerationConfig
from drelay_model.decoding.history import VerifiedHistory
from drelay_model.decoding.cost_policy import CostPolicy, RoundCosts
from drelay_model.decoding.logprobs import round_logprobs
from drelay_model.decoding.rounds import PathChoice, RoundPlan, RoundResult, RoundTimer, Verified
from drelay_model.decoding.stats import DecodeStats
from drelay_model.drafter.model import BlockDrafter
from drelay_model.errors import DRelayError
from drelay_model.kernels.cpu_linear import CpuKernels
from drelay_model.kernels.threads import ThreadPolicy
from drelay_model.selectors.base import Selector
from drelay_model.selectors.native import NativeSelector
from drelay_model.target.model import TargetModel

# accept(path [R, G], target logits [R, G+1, V], length [R][, proposal]) → (accepted [R], next token [R])
AcceptRule = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# sampler(selector, block, selection context) → a Selection whose path was sampled (T > 0)
Sampler = Callable[..., object]


@dataclass
class GenerationResult:
    """tokens[b] = the generated ids of prompt b (prompt excluded, EOS included if hit)."""

    tokens: list[list[int]]
    stats: DecodeStats


class SpeculativeEngine:
    """Runs a target with an optional drafter + selector. Without a drafter it decodes AR."""

    def __init__(
        self,
        target: TargetModel,
        drafter: BlockDrafter | None = None,
        selector: Selector | None = None,
        *,
        costs: RoundCosts | None = None,
        threads: ThreadPolicy | None = None,
    ):
        """costs: measured round costs; given, the verification length is cost-aware (see
        `cost_policy/`); None: every round verifies the selector's whole path (the paper's setting).
        threads: the CPU thread policy its rounds consult (`kernels/threads.py`: the cores other
        processes leave free); None: torch's thread count as the caller set it."""
        if drafter is not None:
            drafter.config.check_target(target)
            selector = selector if selector is not None else NativeSelector()
        self.target = target
        self.drafter = drafter.eval() if drafter is not None else None
        self.selector = selector.eval() if selector is not None else None
        self.feature_layers = drafter.config.target_layer_ids if drafter is not None else ()
        self.num_slots = drafter.config.num_slots if drafter is not None else 0
        self.history_len = self.selector.capabilities.history_len if self.selector is not None else 0
        self.costs = costs if drafter is not None else None
        self.threads = threads
        # The cost-aware policy learns acceptance rates, calibration and cost scales as it decodes;
        # it carries them from one generate() call to the next (as a server's traffic would), so a
        # short request does not pay for learning from scratch. Outputs never depend on it (lossless);
        # assign a fresh CostPolicy to start cold.
        self._native = NativeSelector()  # the path a two-armed policy's native-arm rounds keep
        self.policy = self.new_policy()
        self.device = target.device
        for name, part in (("drafter", self.drafter), ("selector", self.selector)):
            where = {p.device for p in part.parameters()} | {b.device for b in part.buffers()} if part is not None else set()
            if where - {self.device}:
                raise DRelayError(
                    f"{name} is on {sorted(map(str, where))} but the target is on {self.device}: move it with .to()"
                )

    # ---- public --------------------------------------------------------------------------------
    @property
    def cpu_kernels(self) -> CpuKernels:
        """The CPU kernel settings this engine decodes with: its drafter's (which it takes from the
        target unless given its own), else its target's (`kernels/cpu_linear.py`)."""
        return (self.drafter if self.drafter is not None else self.target).cpu_kernels

    def describe_kernels(self) -> str:
        """One line: the CPU kernel settings and what of them takes effect on this engine's device."""
        return self.cpu_kernels.describe(self.device, self.target.dtype)

    def new_policy(self) -> CostPolicy | None:
        """A cold cost-aware policy for this engine (None without measured costs). A selector other
        than `native` gets a second arm: drafted rounds that keep the native path without it."""
        if self.costs is None:
            return None
        return CostPolicy(self.costs, self.num_slots, native_arm=not self.selector.capabilities.native_path)

    @torch.inference_mode()
    def generate(
        self, prompts: list[list[int]], config: GenerationConfig = GenerationConfig(), *, seeds: list[int] | None = None
    ) -> GenerationResult:
        """Generate for a batch of tokenized prompts (lengths may differ): submit them all to a
        continuous batcher (the loop the endpoint serves from; admitted together, prefilled by length
        groups, one batch from the first round) and run it until every row has finished.

        Every `config` field means what it means for one of the batcher's requests (sampling
        knobs, stop, draft sampling). Sampling (T > 0) draws request b's tokens from its own
        numbers, seeded with seeds[b] (default config.seed + b; `draws.py`): a request's output
        depends on its prompt and seed only, not on the other requests of the batch.
        """
        if not prompts:
            raise DRelayError("no prompts given")
        if seeds is not None and len(seeds) != len(prompts):
            raise DRelayError(f"seeds has {len(seeds)} entries for {len(prompts)} prompts")
        seeds = seeds if seeds is not None else [config.seed + b for b in range(len(prompts))]
        batcher = ContinuousBatcher(self, max_batch=len(prompts), engine_policy=True)
        ids = [batcher.submit(p, config.with_seed(int(s)), what=f"prompt {b}") for b, (p, s) in enumerate(zip(prompts, seeds))]
        t_start = time.perf_counter()
        out = batcher.run()
        stats = batcher.stats
        stats.time_total = time.perf_counter() - t_start  # the whole call's wall time, bookkeeping included
        return GenerationResult(tokens=[out[i] for i in ids], stats=stats)

    # ---- the phases ----------------------------------------------------------------------------
    def prefill(
        self, prompts: list[list[int]], rows: list[int], capacity: int, into: BatchState | None = None
    ) -> tuple[BatchState, torch.Tensor]:
        """Prefill prompts into fresh caches of `capacity` positions, as batch rows `rows`; returns
        the state (no anchor yet: the caller picks it) and the target's logits at each prompt's last
        position [B, V] float32. `into`: a state of these rows whose caches already hold the prompts'
        first tokens (chunked prefill, `admission.py`): `prompts` are then each row's next tokens,
        appended to its caches, its context and its verified history."""
        B, dev = len(prompts), self.device
        lengths = torch.tensor([len(p) for p in prompts])
        P = int(lengths.max())
        ids = torch.zeros(B, P, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = torch.tensor(p)
        ids, lengths = ids.to(dev), lengths.to(dev)  # one host→device copy each
        state = into if into is not None else BatchState(rows=list(rows), cache=self.target.new_cache(B, capacity))
        start = state.cache.lengths.clone()  # [B]: 0, or the tokens an earlier chunk prefilled
        res = self.target(ids, state.cache, feature_layers=self.feature_layers, logits_at=(lengths - 1)[:, None])
        state.cache.crop(start + lengths)
        if self.drafter is not None:
            state.ctx = state.ctx if into is not None else self.drafter.new_context_cache(B, capacity)
            self.drafter.extend_context(res.features, state.ctx)
            state.ctx.crop(start + lengths)
        if self.history_len:
            if into is None:
                F = res.features.shape[-1]
                state.history = VerifiedHistory(B, self.history_len, F, dtype=res.features.dtype, device=dev)
            state.history.push(res.features, lengths)
        return state, res.logits[:, 0]

    def round(self, state: BatchState, accept_rule: AcceptRule, stats: DecodeStats,
              policy: CostPolicy | None = None, sampler: Sampler | None = None,
              logprobs: Sequence[int | None] | None = None) -> RoundResult:  # fmt: skip
        """One batched round over every row of `state`: plan → draft → select → verify → commit.

        `accept_rule` is the acceptance rule (the continuous batcher's `sampling.accept_rows` with
        each row's settings); `sampler` replaces the choice of a selector that samples
        its path (`capabilities.samples_path`) with a sampled one, whose proposal then goes to
        `accept_rule`. With a policy, the round consults it once (`plan`) and its plan learns from the
        round's outcome and phase times (`PolicyRound.learn`). `logprobs`
        (one entry per row: k alternatives, or None) asks for the committed tokens' log-probabilities
        from the verify logits (`logprobs.round_logprobs`; rows with None cost nothing)."""
        timer = RoundTimer()
        plan = self.plan(policy, rows=state.anchor.shape[0])
        if plan.drafts:
            timer.mark("draft_start")
            block = self.draft(state, plan, timer)
            choice = self.select(state, block, plan, sampler)
            timer.mark("selected")
            stats.drafted_steps += 1
            stats.selector_steps += int(plan.runs_selector)
        else:  # an AR round: verify the anchor alone
            R, dev = state.anchor.shape[0], state.anchor.device
            choice = PathChoice(torch.empty(R, 0, dtype=torch.long, device=dev), torch.zeros(R, dtype=torch.long, device=dev))
        verified = self.verify(state, choice, accept_rule, timer)
        self.commit(state, choice, verified)
        timer.record(stats)
        if plan.cost is not None:
            plan.cost.learn(timer.times(verify_width=1 + choice.path.shape[1]), choice.q, choice.length, verified.accepted)
        lp = None
        if logprobs is not None and any(k is not None for k in logprobs):
            lp = round_logprobs(verified.logits, choice.path, verified.accepted, verified.next_token, logprobs)
        return RoundResult(
            verified.accepted, verified.next_token, choice.path, logprobs=lp, length=choice.length, drafted=plan.drafts
        )

    def plan(self, policy: CostPolicy | None, rows: int = 1) -> RoundPlan:
        """How many path tokens a round over `rows` rows may verify (all H without a policy; 0 = an
        AR round), how many slots get an LM head, and which selector picks the path (a two-armed
        policy's native-arm rounds keep the native path without running the selector). The round's
        one consultation of the policy (`CostPolicy.round`)."""
        H = self.num_slots
        if policy is None:
            if self.drafter is None:
                return RoundPlan(0, 0, self.selector, True, rows)
            return RoundPlan(H, H, self.selector, True, rows)
        cost = policy.round(rows=rows, partial=self.selector.capabilities.partial_block)
        selector = self.selector if cost.runs_selector else self._native
        return RoundPlan(cost.verify_slots, cost.head_slots, selector, cost.runs_selector, rows, cost)

    def draft(self, state: BatchState, plan: RoundPlan, timer: RoundTimer):
        """Catch the drafter's context up with the verified features it has not seen, then draft one
        block from each row's anchor with LM heads on `plan.head_slots` slots → a `DraftBlock`."""
        H = self.num_slots
        state.sync_context(self.drafter)
        timer.mark("synced")
        block = self.drafter.draft(state.anchor, state.ctx, slots=plan.head_slots if plan.head_slots < H else None)
        timer.mark("drafted")
        return block

    def select(self, state: BatchState, block, plan: RoundPlan, sampler: Sampler | None) -> PathChoice:
        """The path each row submits: the plan's selector (or the sampler) over the block; with a
        cost policy, the batch's paths are cut where verifying more stops paying (`PolicyRound.cut`:
        one length for the batch, since the verify forward is as wide as its longest row)."""
        planned, selector = plan.verify_slots, plan.selector
        ctx = state.selection_context(max_slots=planned if planned < self.num_slots else None)
        samples = sampler is not None and selector.capabilities.samples_path
        selection = sampler(selector, block, ctx) if samples else selector.select(block, ctx)
        proposal = (block.cand_ids, selection.proposal_q) if selection.proposal_q is not None else None
        choice = PathChoice(selection.path_ids, selection.length, proposal=proposal)
        if plan.cost is not None:
            chosen = selection.pool_index[:, :planned, None]
            q = block.cand_logq[:, :planned].gather(2, chosen)[:, :, 0].float().exp()  # [R, planned]
            length = torch.minimum(choice.length, plan.cost.cut(q))
            G = int(length.max())  # one host sync: the verify forward's width
            choice = PathChoice(choice.path[:, :G], length, q[:, :G], proposal)
        return choice

    def verify(self, state: BatchState, choice: PathChoice, accept_rule: AcceptRule, timer: RoundTimer) -> Verified:
        """One target forward over [anchor, path] per row, then the acceptance rule."""
        start = state.cache.lengths.clone()
        timer.mark("verify_start")
        res = self.target(torch.cat([state.anchor[:, None], choice.path], dim=1), state.cache, feature_layers=self.feature_layers)
        timer.mark("verified")
        if choice.proposal is None:
            accepted, next_token = accept_rule(choice.path, res.logits, choice.length)
        else:
            accepted, next_token = accept_rule(choice.path, res.logits, choice.length, choice.proposal)
        return Verified(start, res.features, accepted, next_token, res.logits)

    def commit(self, state: BatchState, choice: PathChoice, verified: Verified) -> None:
        """Keep the anchor and the accepted drafts in the target's cache; queue their features for
        the drafter's context (it catches up when it next drafts); the next token becomes the new,
        uncached anchor."""
        state.cache.crop(verified.start + 1 + verified.accepted)
        if state.ctx is not None:
            state.defer(verified.features, None if choice.path.shape[1] == 0 else verified.accepted + 1)
        state.anchor = verified.next_token

    # ---- validation ----------------------------------------------------------------------------
    def check_prompt(self, prompt: list[int], config: GenerationConfig, what: str = "prompt") -> int:
        """Validate one tokenized prompt for this target under `config`'s token budget; returns the KV
        positions its row needs (`GenerationConfig.kv_positions`). One-line DRelayErrors."""
        if len(prompt) == 0:
            raise DRelayError(f"{what} is empty")
        if min(prompt) < 0 or max(prompt) >= self.target.vocab_size:
            raise DRelayError(f"{what} has token ids outside [0, {self.target.vocab_size})")
        return config.check_prompt(len(prompt), max_positions=self.target.max_positions, num_slots=self.num_slots, what=what)
