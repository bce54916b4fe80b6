"""`GenerationConfig`: the one owner and validator of decoding settings.

Everything that decodes (the CLI, evaluation, comparison, studies, regeneration, serving) builds one
of these instead of carrying raw `max_new_tokens` / `temperature` values, so the defaults, the checks
and the context budget are written once:

    greedy          temperature == 0: argmax verification, deterministic
    draft_sampling  at T > 0, a selector that can sample its path (native) draws it from the drafter's
                    tempered pool and verification accepts with min(1, p/q) (verify.accept_sampled);
                    False, or a deterministic selector: the path is chosen as at T = 0 and a draft is
                    accepted while it equals the target's own sample (verify.accept). Both lossless.
    context budget  a prompt of P tokens needs P + max_new_tokens + H + 2 KV positions
                    (H draft slots + the anchor verified in the last round, + the bonus token), so
                    P ≤ max_positions − max_new_tokens − H − 2
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from drelay_model.errors import DRelayError

DEFAULT_MAX_NEW_TOKENS = 256
MAX_TEMPERATURE = 100.0


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0  # 0 = greedy; > 0 samples from softmax(logits / T), still lossless
    seed: int = 0
    stop_on_eos: bool = True
    draft_sampling: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise DRelayError(f"max_new_tokens must be an integer ≥ 1, got {self.max_new_tokens!r}")
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= MAX_TEMPERATURE):
            raise DRelayError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def with_seed(self, seed: int) -> "GenerationConfig":
        return replace(self, seed=seed)

    def prompt_limit(self, max_positions: int, num_slots: int) -> int:
        """The longest prompt that fits the context window with this token budget."""
        return max_positions - self.kv_positions(0, num_slots)

    def kv_positions(self, prompt_len: int, num_slots: int) -> int:
        """KV-cache positions one row needs: prompt + budget + one verify block (H + anchor) + 1."""
        return prompt_len + self.max_new_tokens + num_slots + 2

    def check_prompt(self, n_tokens: int, *, max_positions: int, num_slots: int, what: str = "prompt") -> None:
        """A one-line DRelayError when a prompt of `n_tokens` cannot fit the context window."""
        limit = self.prompt_limit(max_positions, num_slots)
        if n_tokens > limit:
            raise DRelayError(
                f"{what} has {n_tokens} tokens; the target's context window ({max_positions}) leaves room "
                f"for at most {limit} with max_new_tokens={self.max_new_tokens}"
            )
