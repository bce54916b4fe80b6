"""Drafter hyper-parameters and the target fingerprint a checkpoint is tied to."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from drelay_model.errors import DRelayError


@dataclass(frozen=True)
class TargetFingerprint:
    """What a drafter checkpoint assumes about its target; checked on load."""

    model_type: str
    hidden_size: int
    vocab_size: int
    num_layers: int

    @classmethod
    def of(cls, target) -> "TargetFingerprint":
        return cls(target.config.model_type, target.hidden_size, target.vocab_size, target.num_layers)


@dataclass(frozen=True)
class DrafterConfig:
    """A DFlash-style block drafter.

    The drafter's width equals the target's (`hidden_size`) so that it can share the target's frozen
    embedding and LM head. A block is `block_size` positions: the anchor (slot 0) and `H =
    block_size - 1` masked slots, each proposing a pool of `top_k` candidates.
    """

    hidden_size: int
    target_layer_ids: tuple[int, ...]
    num_layers: int = 2
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    intermediate_size: int = 1536
    block_size: int = 16
    top_k: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 100_000.0
    # Size of the frequency-ranked draft vocabulary (a subset of the target's LM-head rows); None
    # means the full target vocabulary. The mapping itself is a buffer in the checkpoint.
    draft_vocab_size: int | None = None
    # Where the projected context c = ctx_norm(W_fc f) meets each layer's input norm. True: every
    # layer's K/V read in_norm_l(c), as the block's do (the layout trained here). False: every
    # layer's K/V read c as it is (DFlash's layout: z-lab, SpecForge, vLLM, SGLang; `drelay import`).
    context_layer_norm: bool = True
    target: TargetFingerprint | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        checks = {
            "hidden_size": self.hidden_size > 0,
            "num_layers": self.num_layers >= 1,
            "num_heads": self.num_heads >= 1 and self.num_heads % max(self.num_kv_heads, 1) == 0,
            "num_kv_heads": self.num_kv_heads >= 1,
            "head_dim": self.head_dim > 0 and self.head_dim % 2 == 0,
            "intermediate_size": self.intermediate_size > 0,
            "block_size": 2 <= self.block_size <= 64,
            "top_k": self.top_k >= 1,
            "target_layer_ids": len(self.target_layer_ids) >= 1 and min(self.target_layer_ids) >= 0,
            "draft_vocab_size": self.draft_vocab_size is None or self.draft_vocab_size >= self.top_k,
            "context_layer_norm": isinstance(self.context_layer_norm, bool),
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise DRelayError(f"invalid drafter config: bad value for {', '.join(bad)}")

    @property
    def num_slots(self) -> int:
        """H: masked slots per block (the anchor is not predicted)."""
        return self.block_size - 1

    def check_target(self, target) -> None:
        """Raise a one-line DRelayError if this drafter cannot run on `target`."""
        if self.hidden_size != target.hidden_size:
            raise DRelayError(
                f"drafter hidden_size {self.hidden_size} does not match target '{target.name}' ({target.hidden_size})"
            )
        if max(self.target_layer_ids) >= target.num_layers:
            raise DRelayError(
                f"drafter target_layer_ids {list(self.target_layer_ids)} out of range for target "
                f"'{target.name}' with {target.num_layers} layers"
            )
        if self.target is not None and self.target != TargetFingerprint.of(target):
            raise DRelayError(
                f"drafter was trained for a different target ({self.target}) than '{target.name}' "
                f"({TargetFingerprint.of(target)})"
            )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "DrafterConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise DRelayError(f"drafter config has unknown keys: {', '.join(unknown)}")
        data = dict(data)
        if data.get("target") is not None:
            data["target"] = TargetFingerprint(**data["target"])
        data["target_layer_ids"] = tuple(data.get("target_layer_ids", ()))
        try:
            return cls(**data)
        except TypeError as exc:
            raise DRelayError(f"drafter config is incomplete: {exc}") from exc

    @classmethod
    def for_target(cls, target, **overrides) -> "DrafterConfig":
        """A default drafter for `target`: width and heads from the target, features from early,
        middle and late layers (DFlash's choice)."""
        L = target.num_layers
        layer_ids = tuple(sorted({min(1, L - 1), L // 2, max(L - 2, 0)}))
        base = dict(
            hidden_size=target.hidden_size,
            target_layer_ids=layer_ids,
            num_heads=target.n_heads,
            num_kv_heads=target.n_kv_heads,
            head_dim=target.head_dim,
            intermediate_size=getattr(target.config, "intermediate_size", 4 * target.hidden_size),
            rms_norm_eps=target.eps,
            target=TargetFingerprint.of(target),
        )
        base.update(overrides)
        return cls(**base)
