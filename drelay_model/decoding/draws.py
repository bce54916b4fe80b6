"""A sampled request's random numbers, keyed by output position (T > 0).

The target's token at output position t is drawn by inverse CDF from u_t, the t-th number of a
uniform stream seeded by the request's seed:

    x_t = min{ v : Σ_{w ≤ v} p̃_t(w) > u_t · Σ_w p̃_t(w) }        (p̃_t: the target's tempered,
                                                                  filtered conditional at t)

A round that verifies G drafts after n committed tokens reads u_n … u_{n+G} (`token_uniforms`, a
peek) and consumes only the numbers of the tokens it commits (`commit`). While the drafts match,
the verified prefix is the true one, so x_{n+j} is exactly the token autoregressive sampling draws
with the same seed; at the first mismatch that token is committed and the round ends. Hence a
seeded request commits the same tokens whatever was drafted, whatever the verification length or
the batch around it — the sampling counterpart of greedy losslessness — and each x_t, a function
of a fresh uniform, is a draw from p̃_t (the distribution is unchanged).

The speculative-sampling rule for sampled paths (`verify.accept_sampled`) tests drafts against a
second stream (`test_uniforms`), so the residual draw at a rejection is independent of the test
that rejected; a sampled path draws from `proposals`. Numbers come from CPU generators (the same
stream on every device) in float64, in chunks, moved to the request's device once per chunk.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

_CHUNK = 64  # uniforms drawn per refill of a stream


def _derived_seed(seed: int, stream: str) -> int:
    """A 63-bit seed for one named stream of a request (stable across runs, processes and machines)."""
    digest = hashlib.blake2b(f"{int(seed)}:{stream}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class _UniformStream:
    """Uniforms u_0, u_1, … in [0, 1): `peek(n)` reads the next n without consuming them."""

    def __init__(self, seed: int, device: torch.device | str) -> None:
        self._gen = torch.Generator().manual_seed(seed)
        self._device = torch.device(device)
        self._buffer = torch.empty(0, dtype=torch.float64, device=self._device)

    def peek(self, n: int) -> torch.Tensor:
        short = n - self._buffer.numel()
        if short > 0:
            more = torch.rand(max(short, _CHUNK), generator=self._gen, dtype=torch.float64)
            self._buffer = torch.cat([self._buffer, more.to(self._device)])
        return self._buffer[:n]

    def consume(self, n: int) -> None:
        self.peek(n)
        self._buffer = self._buffer[n:]


class RowDraws:
    """One sampled request's streams (module docstring): tokens, acceptance tests, proposals."""

    def __init__(self, seed: int, device: torch.device | str = "cpu") -> None:
        self._tokens = _UniformStream(_derived_seed(seed, "tokens"), device)
        self._tests = _UniformStream(_derived_seed(seed, "tests"), device)
        self.proposals = torch.Generator(device=device).manual_seed(_derived_seed(seed, "proposals"))

    def token_uniforms(self, n: int) -> torch.Tensor:
        """u for the next n output positions [n] float64 (not consumed)."""
        return self._tokens.peek(n)

    def test_uniforms(self, n: int) -> torch.Tensor:
        """Acceptance-test uniforms for the next n positions [n] float64 (not consumed)."""
        return self._tests.peek(n)

    def commit(self, n: int) -> None:
        """n more tokens were committed: their positions' numbers are used up."""
        self._tokens.consume(n)
        self._tests.consume(n)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [T, V] (non-negative, any positive total) and u [T] in [0, 1) → [T] int64: the first
    token whose cumulative mass exceeds u · total (a zero-mass token is never returned)."""
    cdf = probs.double().cumsum(dim=-1)  # [T, V]
    total = cdf[:, -1:]
    # u · total < total strictly, so the search never runs past the last token with mass.
    target = torch.minimum(u.to(cdf)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp(max=probs.shape[-1] - 1)


def commit_rows(draws: Sequence[RowDraws | None] | None, committed: Sequence[int]) -> None:
    """Consume each sampled row's numbers for the tokens it committed this round (None: greedy)."""
    if draws is None:
        return
    for d, n in zip(draws, committed):
        if d is not None:
            d.commit(int(n))
