"""Shared parts of the trainable pool heads (`dcoco`, `dflash2`, `domino`, `dspark`).

Each head re-scores the drafter's pool with a residual on top of the drafter's own log-probabilities,
    S_ik = log q_ik + Δ_ik(prefix, block)                         [B, H, K]
and walks the block slot by slot, taking argmax_k S_ik given the token it chose before. Every
residual's output layer starts at zero, so a fresh head serves exactly the native path (candidates
are sorted by q, and argmax takes the first of equal scores).

Training is teacher-forced: the prefix holds the target's labels, and each slot whose label is in the
pool contributes the pool cross-entropy −log softmax_k(S_ik)[k_i] (pool misses contribute nothing,
as in DRelay's Eq. 3).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from drelay_model.drafter.model import DraftBlock
from drelay_model.errors import DRelayError
from drelay_model.selectors.base import Selector


@dataclass(frozen=True)
class HeadConfig:
    """Base of the heads' hyper-parameters (saved as `meta["selector"]["config"]` in a checkpoint).
    Subclasses list their fields and `checks()`; sizes that follow from the drafter are not config."""

    selector_name: ClassVar[str] = "?"

    def checks(self) -> dict[str, bool]:
        return {}

    def __post_init__(self) -> None:
        bad = [name for name, ok in self.checks().items() if not ok]
        if bad:
            raise DRelayError(f"invalid {self.selector_name} selector config: bad value for {', '.join(bad)}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict | None) -> "HeadConfig":
        """Build from a (possibly partial) dict; unknown keys are a one-line DRelayError."""
        data = dict(data or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise DRelayError(f"{cls.selector_name} selector config has unknown keys: {', '.join(unknown)}")
        for name, value in data.items():  # YAML writes 1.0 as 1: accept ints for float fields
            if known[name].type in ("float", float) and isinstance(value, int) and not isinstance(value, bool):
                data[name] = float(value)
        return cls(**data)


def positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


class PoolHead(Selector):
    """A trainable selector that re-scores the pool; sized from a drafter, sharing its frozen embedding."""

    config_cls: ClassVar[type[HeadConfig]] = HeadConfig

    def __init__(self, config: HeadConfig, *, embed_weight: torch.Tensor, hidden_size: int, num_slots: int, top_k: int):
        super().__init__()
        if top_k < 2 or num_slots < 1:
            raise DRelayError(
                f"selector '{config.selector_name}' needs a pool of at least 2 candidates (got K={top_k}, H={num_slots})"
            )
        self.config = config
        self.hidden_size, self.num_slots, self.top_k = hidden_size, num_slots, top_k
        # Frozen, shared with the drafter/target; never saved in a checkpoint.
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)

    @classmethod
    def build(cls, *, drafter=None, config: dict | None = None) -> "PoolHead":
        if drafter is None:
            raise DRelayError(f"selector '{cls.config_cls.selector_name}' needs a drafter to size itself (build(drafter=...))")
        dc = drafter.config
        return cls(
            cls.config_cls.from_dict(config),
            embed_weight=drafter.embed_weight,
            hidden_size=dc.hidden_size,
            num_slots=dc.num_slots,
            top_k=dc.top_k,
        )

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids [...] → frozen target embeddings E(ids) [..., D_emb] in the head's dtype."""
        return F.embedding(ids, self.embed_weight).to(self.dtype)

    def check_block(self, block: DraftBlock) -> tuple[int, int, int]:
        B, H, K = block.cand_ids.shape
        if (H, K) != (self.num_slots, self.top_k):
            name = self.config.selector_name
            raise DRelayError(f"{name} selector was built for H={self.num_slots}, K={self.top_k}; got a pool [{B}, {H}, {K}]")
        return B, H, K


def zero_init(layer: nn.Linear) -> nn.Linear:
    """A terminal residual layer: zero weights (and bias), so a fresh head adds nothing."""
    nn.init.zeros_(layer.weight)
    if layer.bias is not None:
        nn.init.zeros_(layer.bias)
    return layer


@dataclass(frozen=True)
class PoolTargets:
    """Where the labels sit in the pool. covered [R, H] bool (label in the pool and supervised);
    index [R, H] int64 its pool index (0 where not covered)."""

    covered: torch.Tensor
    index: torch.Tensor

    @classmethod
    def of(cls, cand_ids: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor) -> "PoolTargets":
        hit = cand_ids == labels[..., None]  # [R, H, K]
        covered = hit.any(dim=-1) & valid
        return cls(covered=covered, index=torch.where(covered, hit.long().argmax(dim=-1), torch.zeros_like(labels)))


def pool_nll(scores: torch.Tensor, targets: PoolTargets) -> torch.Tensor:
    """Pool cross-entropy −log softmax_k(S_ik)[k_i] where covered, else 0. scores [R, H, K] → [R, H] float32."""
    nll = -scores.float().log_softmax(dim=-1).gather(-1, targets.index[..., None])[..., 0]
    return torch.where(targets.covered, nll, torch.zeros_like(nll))


@torch.no_grad()
def choice_metrics(scores: torch.Tensor, cand_ids: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor) -> dict[str, float]:
    """Teacher-forced argmax_k S_ik against the native choice, as shares of the valid slots:
    selector/acc, selector/native_acc, selector/repair_rate (picks k > 0), selector/fixed, selector/broke."""
    pick = scores.argmax(dim=-1)  # [R, H]
    chosen = cand_ids.gather(-1, pick[..., None])[..., 0]
    native_ok, chosen_ok, repair = (cand_ids[..., 0] == labels) & valid, (chosen == labels) & valid, (pick > 0) & valid
    n = valid.sum().clamp(min=1)
    shares = {"acc": chosen_ok, "native_acc": native_ok, "repair_rate": repair,
              "fixed": repair & chosen_ok & ~native_ok, "broke": repair & native_ok & ~chosen_ok}  # fmt: skip
    return {f"selector/{k}": float(v.sum() / n) for k, v in shares.items()}
