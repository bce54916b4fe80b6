"""The decoding engine: batched rounds of draft → select → verify → commit.

    prefill:  target(prompt) → KV cache, context features, first token x₀ (the first anchor)
    round:    block  = drafter(anchor, context)            pool [B, H, K]
              path   = selector(block)                     [B, H] (≤ H tokens per row)
              logits = target([anchor, path])              one forward over 1 + H tokens
              n, x   = accept(path, logits)                longest matching prefix, target's token
              commit path[:n] + [x]; crop both caches to the accepted length; anchor ← x

Autoregressive decoding (no drafter) is the same loop with an empty path, so AR and speculative
timings come from one code path. The engine knows nothing about tokenization: token ids in and out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from drelay_model.decoding.stats import DecodeStats
from drelay_model.decoding.verify import accept, pick_tokens
from drelay_model.drafter.model import BlockDrafter
from drelay_model.errors import DRelayError
from drelay_model.selectors.base import SelectionContext, Selector
from drelay_model.selectors.native import NativeSelector
from drelay_model.target.model import TargetModel


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    stop_on_eos: bool = True

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise DRelayError(f"max_new_tokens must be ≥ 1, got {self.max_new_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise DRelayError(f"temperature must be in [0, 100], got {self.temperature}")


@dataclass
class GenerationResult:
    """tokens[b] = the generated ids of prompt b (prompt excluded, EOS included if hit)."""

    tokens: list[list[int]]
    stats: DecodeStats


class SpeculativeEngine:
    """Runs a target with an optional drafter + selector. Without a drafter it decodes AR."""

    def __init__(self, target: TargetModel, drafter: BlockDrafter | None = None, selector: Selector | None = None):
        if drafter is not None:
            drafter.config.check_target(target)
            selector = selector if selector is not None else NativeSelector()
            if selector.capabilities.history_len > 0:
                raise DRelayError(f"selector {type(selector).__name__} needs verified history, which this engine does not provide")
        self.target = target
        self.drafter = drafter.eval() if drafter is not None else None
        self.selector = selector.eval() if selector is not None else None
        self.feature_layers = drafter.config.target_layer_ids if drafter is not None else ()
        self.num_slots = drafter.config.num_slots if drafter is not None else 0

    # ---- public --------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], config: GenerationConfig = GenerationConfig()) -> GenerationResult:
        """Generate for a batch of tokenized prompts (lengths may differ)."""
        self._check_prompts(prompts, config)
        stats = DecodeStats(num_slots=self.num_slots)
        gen = torch.Generator().manual_seed(config.seed) if config.temperature > 0 else None
        eos = set(self.target.eos_token_ids) if config.stop_on_eos else set()
        t_start = time.perf_counter()

        cache, ctx, anchor = self._prefill(prompts, config, gen)
        stats.time_prefill = time.perf_counter() - t_start
        out: list[list[int]] = [[t] for t in anchor.tolist()]
        rows = [b for b in range(len(prompts)) if not self._finished(out[b], config, eos)]
        if len(rows) < len(prompts):
            cache, ctx, anchor = self._keep(rows, range(len(prompts)), cache, ctx, anchor)
        while rows:
            row_ids = torch.tensor(rows, dtype=torch.long)
            accepted, next_tok, path = self._round(cache, ctx, anchor, row_ids, config, gen, stats)
            done, committed = [], []
            n_list, x_list, p_list = accepted.tolist(), next_tok.tolist(), path.tolist()  # one host copy
            for i, b in enumerate(rows):
                committed.append(self._commit(out[b], p_list[i][: n_list[i]] + [x_list[i]], config, eos))
                if self._finished(out[b], config, eos):
                    done.append(b)
            stats.record_round(n_list, committed)
            stats.steps += 1
            if done:
                keep = [b for b in rows if b not in done]
                cache, ctx, anchor = self._keep(keep, rows, cache, ctx, next_tok)
                rows = keep
            else:
                anchor = next_tok
        stats.generated = sum(len(o) for o in out)
        stats.time_total = time.perf_counter() - t_start
        return GenerationResult(tokens=out, stats=stats)

    # ---- phases --------------------------------------------------------------------------------
    def _prefill(self, prompts, config: GenerationConfig, gen):
        B = len(prompts)
        lengths = torch.tensor([len(p) for p in prompts])
        P = int(lengths.max())
        ids = torch.zeros(B, P, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = torch.tensor(p)
        capacity = P + config.max_new_tokens + self.num_slots + 2
        cache = self.target.new_cache(B, capacity)
        res = self.target(ids, cache, feature_layers=self.feature_layers, logits_at=(lengths - 1)[:, None])
        cache.crop(lengths)
        ctx = None
        if self.drafter is not None:
            ctx = self.drafter.new_context_cache(B, capacity)
            self.drafter.extend_context(res.features, ctx)
            ctx.crop(lengths)
        first = pick_tokens(res.logits[:, 0], config.temperature, gen)  # [B]
        return cache, ctx, first

    def _round(self, cache, ctx, anchor, row_ids, config: GenerationConfig, gen, stats: DecodeStats):
        """One batched round; returns accepted [R], next token [R], path [R, G].

        Timing: `draft` = drafter forwards (block + context extension), `select` = the selector,
        `verify` = the target forward; everything else (acceptance, cache crops, host bookkeeping)
        lands in `other`, the engine's own overhead.
        """
        R = anchor.shape[0]
        clock = time.perf_counter
        if self.drafter is None:
            path = torch.empty(R, 0, dtype=torch.long)
            length = torch.zeros(R, dtype=torch.long)
        else:
            t0 = clock()
            block = self.drafter.draft(anchor, ctx)
            t1 = clock()
            sctx = SelectionContext(anchor_ids=anchor, anchor_pos=cache.lengths.clone(), row_ids=row_ids)
            selection = self.selector.select(block, sctx)
            path, length = selection.path_ids, selection.length
            stats.time_draft += t1 - t0
            stats.time_select += clock() - t1
        start = cache.lengths.clone()
        t0 = clock()
        res = self.target(torch.cat([anchor[:, None], path], dim=1), cache, feature_layers=self.feature_layers)
        stats.time_verify += clock() - t0
        accepted, next_tok = accept(path, res.logits, length, temperature=config.temperature, generator=gen)
        # Keep the anchor and the accepted drafts; the next token becomes the new (uncached) anchor.
        cache.crop(start + 1 + accepted)
        if ctx is not None:
            t0 = clock()
            self.drafter.extend_context(res.features, ctx)
            stats.time_draft += clock() - t0
            ctx.crop(start + 1 + accepted)
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

    @staticmethod
    def _keep(keep: list[int], rows, cache, ctx, anchor):
        """Drop finished rows from every per-row state."""
        index = torch.tensor([list(rows).index(b) for b in keep], dtype=torch.long)
        cache.select_rows(index)
        if ctx is not None:
            ctx.select_rows(index)
        return cache, ctx, anchor[index]

    def _check_prompts(self, prompts: list[list[int]], config: GenerationConfig) -> None:
        if not prompts:
            raise DRelayError("no prompts given")
        limit = self.target.max_positions - config.max_new_tokens - self.num_slots - 2
        for b, p in enumerate(prompts):
            if len(p) == 0:
                raise DRelayError(f"prompt {b} is empty")
            if len(p) > limit:
                raise DRelayError(
                    f"prompt {b} has {len(p)} tokens; the target's context window "
                    f"({self.target.max_positions}) leaves room for at most {limit} with "
                    f"max_new_tokens={config.max_new_tokens}"
                )
            if min(p) < 0 or max(p) >= self.target.vocab_size:
                raise DRelayError(f"prompt {b} has token ids outside [0, {self.target.vocab_size})")
