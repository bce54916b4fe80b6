"""`GenerationConfig`: the one type, default and validator of decode settings.

Everything that decodes (the CLI, evaluation, comparison, studies, regeneration, the continuous
batcher and serving) carries one of these instead of raw `max_new_tokens` / `temperature` values,
so each default and each check is written once. A bad value raises `SettingsError`, whose `field`
names the setting: a caller maps it to its own spelling (a flag, an API parameter).

    greedy          temperature == 0: argmax verification, deterministic
    filters         top_k / top_p restrict sampling to the target's filtered conditional
                    (`sampling.filtered_logits`)
    draft_sampling  at T > 0, a selector that can sample its path (native, and the native arm of a
                    cost-aware policy) draws it from the drafter's tempered pool and verification
                    accepts with min(1, p̃/q) (verify.accept_sampled): an exact draw from p̃, but not
                    autoregressive sampling's. False (the default), or a deterministic selector: the
                    path is chosen as at T = 0 and a draft is accepted while it equals the target's
                    own sample (verify.accept), so a seeded request commits what autoregressive
                    sampling with its seed commits. Both lossless.

Every field means the same wherever it is decoded: `SpeculativeEngine.generate` submits its prompts
to the continuous batcher, which applies each request's settings per row.
    context budget  a prompt of P tokens needs P + max_new_tokens + H + 2 KV positions
                    (H draft slots + the anchor verified in the last round, + the bonus token), so
                    P ≤ max_positions − max_new_tokens − H − 2
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from drelay_model.errors import DRelayError

DEFAULT_MAX_NEW_TOKENS = 256
MAX_TEMPERATURE = 100.0

StopPredicate = Callable[[list[int]], bool]


class SettingsError(DRelayError):
    """A decode setting out of range; `field` is the GenerationConfig field at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field} {message}")
        self.field = field
        self.detail = message  # the message without the field name, for callers that rename it


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True)
class GenerationConfig:
    """One request's (or one batch's) decode settings.

    max_new_tokens  generated-token budget (an integer ≥ 1).
    temperature     0 = greedy; otherwise sample from softmax(logits / T), T ≤ MAX_TEMPERATURE.
    top_p           nucleus mass in (0, 1] (1 = off); top_k ≥ 0 (0 = off).
    seed            seeds the sampling generator(s) (T > 0).
    stop_on_eos     stop after the target's EOS token.
    draft_sampling  see the module docstring (T > 0).
    stop            optional predicate on the generated ids so far: True ends the request after the
                    token that made it true (how a caller implements stop strings: it detokenises;
                    the engine knows nothing about text).
    """

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_on_eos: bool = True
    draft_sampling: bool = False
    stop: StopPredicate | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise SettingsError("max_new_tokens", f"must be an integer ≥ 1, got {self.max_new_tokens!r}")
        if not (_is_number(self.temperature) and math.isfinite(self.temperature) and 0.0 <= self.temperature <= MAX_TEMPERATURE):
            raise SettingsError("temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")
        if not (_is_number(self.top_p) and math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise SettingsError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise SettingsError("top_k", f"must be an integer ≥ 0, got {self.top_k!r}")
        if not _is_int(self.seed):
            raise SettingsError("seed", f"must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def filtered(self) -> bool:
        """Whether sampling is restricted by top-k or top-p."""
        return self.top_p < 1.0 or self.top_k > 0

    @property
    def samples_paths(self) -> bool:
        """Whether a selector that can sample its path draws it (T > 0 with `draft_sampling`)."""
        return self.temperature > 0.0 and self.draft_sampling

    def with_seed(self, seed: int) -> "GenerationConfig":
        return replace(self, seed=seed)

    def prompt_limit(self, max_positions: int, num_slots: int) -> int:
        """The longest prompt that fits the context window with this token budget."""
        return max_positions - self.kv_positions(0, num_slots)

    def kv_positions(self, prompt_len: int, num_slots: int) -> int:
        """KV-cache positions one row needs: prompt + budget + one verify block (H + anchor) + 1."""
        return prompt_len + self.max_new_tokens + num_slots + 2

    def check_prompt(self, n_tokens: int, *, max_positions: int, num_slots: int, what: str = "prompt") -> int:
        """The KV positions a prompt of `n_tokens` needs; a one-line DRelayError when that is over the
        context window."""
        limit = self.prompt_limit(max_positions, num_slots)
        if n_tokens > limit:
            raise DRelayError(
                f"{what} has {n_tokens} tokens, over the target's context window ({max_positions}), which leaves "
                f"room for at most {limit} with max_new_tokens={self.max_new_tokens}"
            )
        return self.kv_positions(n_tokens, num_slots)
