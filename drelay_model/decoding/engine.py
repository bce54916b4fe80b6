"""The decoding engine: batched rounds of draft → select → verify → commit.

    prefill:  target(prompt) → KV cache, context features, first token x₀ (the first anchor)
    round:    block  = drafter(anchor, context)            pool [B, H, K]
              path   = selector(block)                     [B, H] (≤ H tokens per row)
              logits = target([anchor, path])              one forward over 1 + H tokens
              n, x   = accept(path, logits)                longest matching prefix, target's token
              commit path[:n] + [x]; crop both caches to the accepted length; anchor ← x

Autoregressive decoding (no drafter) is the same loop with an empty path, so AR and speculative
timings come from one code path. With measured `costs`, each round verifies the number of path
tokens that maximises expected tokens per second (`verify_length.py`; 0 = an AR round). The engine knows nothing about tokenization: token ids in and out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from drelay_model.decoding.generation import GenerationConfig
from drelay_model.decoding.history import VerifiedHistory
from drelay_model.decoding.stats import DecodeStats
from drelay_model.decoding.verify import accept, accept_sampled, pick_tokens
from drelay_model.decoding.verify_costs import VerifyCosts
from drelay_model.decoding.verify_length import CostAwareLength
from drelay_model.drafter.model import BlockDrafter
from drelay_model.errors import DRelayError
from drelay_model.kv_cache import KVCache
from drelay_model.selectors.base import SelectionContext, Selector
from drelay_model.selectors.native import NativeSelector
from drelay_model.target.model import TargetModel


@dataclass
class _BatchState:
    """Everything per row that lives across rounds; `rows` maps batch rows to request ids."""

    rows: list[int]
    cache: KVCache
    generators: list[torch.Generator] | None = None  # one per live row (sampling only)
    ctx: KVCache | None = None  # drafter context keys/values
    history: VerifiedHistory | None = None
    anchor: torch.Tensor | None = None  # [R] int64
    # Verified target features not yet in the drafter's context (`ctx`) nor in the verified history,
    # one (features [R, T, F], counts [R] or None = all T) per round since the last drafted one:
    # the round that verified them does not need them, so they wait for the next drafted round,
    # which extends by all of them in one call each (`sync_context`) instead of one per round.
    pending: list[tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=list)

    def defer(self, features: torch.Tensor, counts: torch.Tensor | None = None) -> None:
        """Queue a round's verified features: the first counts[r] of row r (None: all T, an AR round)."""
        self.pending.append((features, counts))

    def sync_context(self, drafter: BlockDrafter) -> None:
        """Extend the drafter's context and the history by the pending features.

        Every row's pending features go left-aligned into one [R, T, F] tensor (T = the most any row
        has) at positions ctx.lengths + t, and each row is cropped to its own count: the context
        keys/values are per position (row-independent linears, RoPE by position), so one call
        yields what one call per round would."""
        if not self.pending:
            return
        if all(counts is None for _, counts in self.pending):  # AR rounds only: the same count everywhere
            feats = torch.cat([f for f, _ in self.pending], dim=1)  # [R, n, F]
            total = torch.full_like(self.ctx.lengths, feats.shape[1])
        else:
            total = sum(f.shape[1] if c is None else c for f, c in self.pending)  # [R]
            feats = _left_aligned(self.pending, total)
        start = self.ctx.lengths.clone()
        drafter.extend_context(feats, self.ctx)
        self.ctx.crop(start + total)
        if self.history is not None:
            self.history.push(feats, total)
        self.pending = []

    def selection_context(self, max_slots: int | None = None) -> SelectionContext:
        hist = self.history
        return SelectionContext(
            anchor_ids=self.anchor,
            anchor_pos=self.cache.lengths.clone(),
            row_ids=torch.tensor(self.rows, dtype=torch.long, device=self.anchor.device),
            history=hist.feats if hist is not None else None,
            history_mask=hist.mask() if hist is not None else None,
            max_slots=max_slots,
        )

    def keep(self, rows: list[int]) -> None:
        """Drop finished rows from every per-row state (no-op when all stay)."""
        if rows == self.rows:
            return
        positions = [self.rows.index(b) for b in rows]
        index = torch.tensor(positions, dtype=torch.long, device=self.anchor.device)
        self.cache.select_rows(index)
        if self.generators is not None:
            self.generators = [self.generators[i] for i in positions]
        for part in (self.ctx, self.history):
            if part is not None:
                part.select_rows(index)
        self.pending = [(f[index], None if c is None else c[index]) for f, c in self.pending]
        self.anchor = self.anchor[index]
        self.rows = rows


def _left_aligned(chunks: list[tuple[torch.Tensor, torch.Tensor | None]], total: torch.Tensor) -> torch.Tensor:
    """Chunks (features [R, T_i, F], counts [R] or None = T_i) → [R, max total, F]: row r holds the
    first counts[r] of each chunk's row r, in order, then zeros."""
    first = chunks[0][0]
    R, F = first.shape[0], first.shape[2]
    out = first.new_zeros(R, int(total.max()), F)  # one host sync
    offset = torch.zeros_like(total)
    for f, c in chunks:
        n = torch.full_like(total, f.shape[1]) if c is None else c
        rows, cols = (torch.arange(f.shape[1], device=f.device)[None] < n[:, None]).nonzero(as_tuple=True)
        out[rows, offset[rows] + cols] = f[rows, cols]
        offset = offset + n
    return out


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
        costs: VerifyCosts | None = None,
    ):
        """costs: measured round costs; given, the verification length is cost-aware (see
        `verify_length.py`); None: every round verifies the selector's whole path (the paper's setting)."""
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
        # The cost-aware policy learns acceptance rates, calibration and cost scales as it decodes;
        # it carries them from one generate() call to the next (as a server's traffic would), so a
        # short request does not pay for learning from scratch. Outputs never depend on it (lossless);
        # assign a fresh CostAwareLength to start cold.
        self._native = NativeSelector()  # the path a two-armed policy's native-arm rounds keep
        self.policy = self.new_policy()
        self.device = target.device
        for name, part in (("drafter", self.drafter), ("selector", self.selector)):
            where = {p.device for p in part.parameters()} | {b.device for b in part.buffers()} if part is not None else set()
            if where - {self.device}:
                raise DRelayError(f"{name} is on {sorted(map(str, where))} but the target is on {self.device}: move it with .to()")

    # ---- public --------------------------------------------------------------------------------
    def new_policy(self) -> CostAwareLength | None:
        """A cold cost-aware policy for this engine (None without measured costs). A selector other
        than `native` gets a second arm: drafted rounds that keep the native path without it."""
        if self.costs is None:
            return None
        return CostAwareLength(self.costs, self.num_slots, native_arm=not self.selector.capabilities.native_path)

    @torch.inference_mode()
    def generate(
        self, prompts: list[list[int]], config: GenerationConfig = GenerationConfig(), *, seeds: list[int] | None = None
    ) -> GenerationResult:
        """Generate for a batch of tokenized prompts (lengths may differ).

        Sampling (T > 0) draws request b's tokens from its own generator, seeded with seeds[b]
        (default config.seed + b), on the target's device: a request's output depends on its prompt
        and seed, never on the other requests of the batch.
        """
        self._check_prompts(prompts, config)
        if seeds is not None and len(seeds) != len(prompts):
            raise DRelayError(f"seeds has {len(seeds)} entries for {len(prompts)} prompts")
        stats = DecodeStats(num_slots=self.num_slots, requests=len(prompts))
        gen = None
        if config.temperature > 0:
            seeds = seeds if seeds is not None else [config.seed + b for b in range(len(prompts))]
            gen = [torch.Generator(device=self.device).manual_seed(int(s)) for s in seeds]
        eos = set(self.target.eos_token_ids) if config.stop_on_eos else set()
        t_start = time.perf_counter()

        policy = self.policy
        state = self._prefill(prompts, config, gen)
        state.generators = gen
        stats.time_prefill = time.perf_counter() - t_start
        out: list[list[int]] = [[t] for t in state.anchor.tolist()]
        state.keep([b for b in state.rows if not self._finished(out[b], config, eos)])
        # The acceptance rule; per-row generators are read at call time (rows leave the batch).
        T = config.temperature

        def verify(path, logits, length, proposal=None):
            if proposal is None:
                return accept(path, logits, length, temperature=T, generator=state.generators)
            return accept_sampled(path, logits, length, *proposal, temperature=T, generator=state.generators)

        sampler = None
        if T > 0 and config.draft_sampling:  # used with a selector that samples its path (capabilities)
            sampler = lambda sel, block, ctx: sel.sample(block, ctx, temperature=T, generators=state.generators)  # noqa: E731
        while state.rows:
            accepted, next_tok, path = self._round(state, verify, stats, policy, sampler)
            committed = []
            n_list, x_list, p_list = accepted.tolist(), next_tok.tolist(), path.tolist()  # one host copy
            for i, b in enumerate(state.rows):
                committed.append(self._commit(out[b], p_list[i][: n_list[i]] + [x_list[i]], config, eos))
            stats.record_round(n_list, committed)
            stats.steps += 1
            state.anchor = next_tok
            state.keep([b for b in state.rows if not self._finished(out[b], config, eos)])
        stats.generated = sum(len(o) for o in out)
        stats.time_total = time.perf_counter() - t_start
        return GenerationResult(tokens=out, stats=stats)

    # ---- phases --------------------------------------------------------------------------------
    def _prefill(self, prompts, config: GenerationConfig, gen) -> "_BatchState":
        capacity = config.kv_positions(max(len(p) for p in prompts), self.num_slots)
        state, last_logits = self._prefill_rows(prompts, list(range(len(prompts))), capacity)
        state.anchor = pick_tokens(last_logits, config.temperature, gen)  # [B]
        return state

    def _prefill_rows(self, prompts, rows: list[int], capacity: int) -> tuple["_BatchState", torch.Tensor]:
        """Prefill prompts into fresh caches of `capacity` positions; returns the state (no anchor
        yet) and the target's logits at each prompt's last position [B, V] float32."""
        B, dev = len(prompts), self.device
        lengths = torch.tensor([len(p) for p in prompts])
        P = int(lengths.max())
        ids = torch.zeros(B, P, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = torch.tensor(p)
        ids, lengths = ids.to(dev), lengths.to(dev)  # one host→device copy each
        state = _BatchState(rows=list(rows), cache=self.target.new_cache(B, capacity))
        res = self.target(ids, state.cache, feature_layers=self.feature_layers, logits_at=(lengths - 1)[:, None])
        state.cache.crop(lengths)
        if self.drafter is not None:
            state.ctx = self.drafter.new_context_cache(B, capacity)
            self.drafter.extend_context(res.features, state.ctx)
            state.ctx.crop(lengths)
        if self.history_len:
            state.history = VerifiedHistory(B, self.history_len, res.features.shape[-1], dtype=res.features.dtype, device=dev)
            state.history.push(res.features, lengths)
        return state, res.logits[:, 0]

    def _round(self, state: "_BatchState", verify, stats: DecodeStats, policy: CostAwareLength | None = None, sampler=None):
        """One batched round; returns accepted [R], next token [R], path [R, G].

        `verify(path, target_logits, length[, proposal]) -> (accepted, next_token)` is the acceptance
        rule (`accept` with the call's temperature; the continuous batcher passes per-row settings);
        `sampler(selector, block, ctx) -> Selection` replaces the choice of a selector that samples
        its path (`capabilities.samples_path`) with a sampled one, whose proposal (pool ids, q) then
        goes to `verify`. With a two-armed policy a drafted round may keep the native path instead
        of running the selector (`CostAwareLength.use_selector`).

        Timing: `draft` = drafter forwards (block + context extension), `select` = the selector,
        `verify` = the target forward; everything else (acceptance, cache crops, host bookkeeping)
        lands in `other`, the engine's own overhead.
        """
        anchor, cache = state.anchor, state.cache
        R = anchor.shape[0]
        clock = time.perf_counter
        t_round = clock()
        H = self.num_slots
        # planned: how many path tokens this round may verify (0 = an AR round); head: how many slots
        # get an LM head (= planned, or all H for a selector that reads the whole pool).
        planned = H if policy is None else policy.plan(partial=self.selector.capabilities.partial_block)
        runs_selector = policy is None or policy.use_selector  # False: a native-arm round
        selector = self.selector if runs_selector else self._native
        q = proposal = None
        head, drafting_ms, catch_up_ms = 0, 0.0, 0.0
        if self.drafter is None or planned == 0:  # AR round: verify the anchor alone
            path = torch.empty(R, 0, dtype=torch.long, device=anchor.device)
            length = torch.zeros(R, dtype=torch.long, device=anchor.device)
        else:
            head = planned if selector.capabilities.partial_block else H
            t0 = clock()
            state.sync_context(self.drafter)
            t_synced = clock()
            block = self.drafter.draft(anchor, state.ctx, slots=head if head < H else None)
            t1 = clock()
            ctx = state.selection_context(max_slots=planned if planned < H else None)
            samples = sampler is not None and selector.capabilities.samples_path
            selection = sampler(selector, block, ctx) if samples else selector.select(block, ctx)
            path, length = selection.path_ids, selection.length
            if selection.proposal_q is not None:
                proposal = (block.cand_ids, selection.proposal_q)
            if policy is not None:  # cut each row's path where verifying more stops paying
                chosen = selection.pool_index[:, :planned, None]
                q = block.cand_logq[:, :planned].gather(2, chosen)[:, :, 0].float().exp()  # [R, planned]
                length = torch.minimum(length, policy.choose(q, head))
                G = int(length.max())  # one host sync: the verify forward's width
                path, q = path[:, :G], q[:, :G]
            t2 = clock()
            stats.time_draft += t1 - t0
            stats.time_select += t2 - t1
            stats.drafted_steps += 1
            stats.selector_steps += int(runs_selector)
            if policy is not None:
                # The policy prices a drafted round's own extension (its curve's extend_ms), not the
                # catch-up over the AR rounds before it: those positions are extended whenever drafting
                # resumes, and charging them to this round made drafting look dearer the longer it paused.
                catch_up_ms = 1e3 * (t_synced - t0) - policy.costs.extend_ms
                drafting_ms = 1e3 * (t2 - t0) - catch_up_ms
        start = cache.lengths.clone()
        t0 = clock()
        res = self.target(torch.cat([anchor[:, None], path], dim=1), cache, feature_layers=self.feature_layers)
        verify_s = clock() - t0
        stats.time_verify += verify_s
        accepted, next_tok = verify(path, res.logits, length) if proposal is None else verify(path, res.logits, length, proposal)
        if q is not None:
            policy.observe(q, length, accepted)
        # Keep the anchor and the accepted drafts; the next token becomes the new (uncached) anchor.
        cache.crop(start + 1 + accepted)
        if state.ctx is not None:  # the drafter's context catches up when it next drafts
            state.defer(res.features, None if path.shape[1] == 0 else accepted + 1)
        if policy is not None:  # rescale the cost curve by what this round measured
            policy.observe_times(verify_width=1 + path.shape[1], verify_ms=1e3 * verify_s, head_slots=head,
                                 decided=planned if runs_selector else 0, draft_ms=drafting_ms, round_ms=1e3 * (clock() - t_round) - catch_up_ms)  # fmt: skip
        return accepted, next_tok, path

    # ---- host-side bookkeeping -----------------------------------------------------------------
    @staticmethod
    def _commit(row: list[int], new_tokens: list[int], config: GenerationConfig, eos: set[int]) -> int:
        """Append tokens until EOS or the budget; returns how many were appended."""
        n = 0
        for t in new_tokens:
            if len(row) >= config.max_new_tokens or (row and row[-1] in eos):
                break
            row.append(t)
            n += 1
        return n

    @staticmethod
    def _finished(row: list[int], config: GenerationConfig, eos: set[int]) -> bool:
        return len(row) >= config.max_new_tokens or (bool(row) and row[-1] in eos)

    def _check_prompts(self, prompts: list[list[int]], config: GenerationConfig) -> None:
        if not prompts:
            raise DRelayError("no prompts given")
        for b, p in enumerate(prompts):
            if len(p) == 0:
                raise DRelayError(f"prompt {b} is empty")
            config.check_prompt(len(p), max_positions=self.target.max_positions, num_slots=self.num_slots, what=f"prompt {b}")
            if min(p) < 0 or max(p) >= self.target.vocab_size:
                raise DRelayError(f"prompt {b} has token ids outside [0, {self.target.vocab_size})")
