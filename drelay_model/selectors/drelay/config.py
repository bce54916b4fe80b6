"""DRelay selector hyper-parameters (saved as `meta["selector"]["config"]` in a drafter checkpoint).

Sizes that follow from the drafter (its width D, H slots, K candidates, the feature width F =
len(target_layer_ids)·D) are not part of the config: `DRelaySelector.build` reads them off the
drafter, so a checkpoint's config stays valid for any drafter it is paired with.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from drelay_model.errors import DRelayError


@dataclass(frozen=True)
class DRelayConfig:
    """The DRelay selector (§4): Global Read + Causal Selector.

    d_sel          selector width (256 for the CPU target; the paper's Qwen3-4B selector is 35M
                   parameters, i.e. a much wider d_sel).
    heads          attention heads of every read (Global Read blocks, candidate reads Eq. 1,
                   history and prefix reads); d_sel and read_dim must be divisible by it.
    read_dim       total query/key/value width of the candidate, history and prefix reads (head
                   width d_g = read_dim / heads); below d_sel it keeps the per-block cost low on CPU.
    global_blocks  bidirectional attention–FFN blocks of the slot mixing stage.
    history_len    N: how many of the last strictly verified target features the selector reads
                   (0 turns the history read off).
    ffn_mult       FFN width of the Global Read blocks, as a multiple of d_sel.
    compact_dim    width of each compact candidate-specific correction MLP (causal.py).
    branches       "separate" (§5: "the selector has separate KEEP/REPAIR and ranking branches"):
                   the rank correction ρ' and the gate evidence δ come from two MLPs of width
                   compact_dim that share no weights or hidden units, only their inputs (the
                   candidate state, history and prefix reads); "shared" (checkpoints saved without
                   this key): one MLP of width compact_dim with a 2-column output [ρ', δ].
    global_read    False = the "No Global Read" ablation: no slot mixing and no candidate reads;
                   the causal selector then sees local slot and candidate features only.
    gate_evidence  what the gate residual Δg_i of Eq. 6 reads (causal.py, `combine`):
                   "contrast" (the paper's reading of §4.3: the gate asks "whether the best available
                   repair justifies leaving the native choice", so it must see which alternative the
                   evidence supports) = the slot query's δ_iK plus the alternatives' own gate
                   evidence weighted by the rank distribution, minus the native candidate's:
                   Δg_i = δ_iK + Σ_{k>0} r_ik δ_ik − δ_i0;
                   "slot" (checkpoints saved without this key) = Δg_i = δ_iK, the slot query alone.
    anchor_feature True (Fig. 3's "anchor-feature projection"): the anchor's prefix-memory entry adds
                   LN(W_F f_a), f_a = the target feature that produced the anchor (the newest
                   verified feature), projected by the history read's own W_F and LN; False
                   (checkpoints saved without this key): g_a + p_0 + W_x E(x_0) only.
    ln_eps         LayerNorm epsilon.
    decisions      how inference finds the H causal decisions (same decisions either way):
                   "walk" = the graph-safe walk (walk.py: fixed work, no host syncs),
                   "passes" = `CausalSelector.decide_block` (parallel passes with early exit).
    kernels        "torch" = the PyTorch reference; "triton" = the Triton kernels of
                   drelay_model/kernels/ for Global Read's candidate attention and the walk
                   (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1).
    """

    d_sel: int = 256
    heads: int = 4
    read_dim: int = 128
    global_blocks: int = 2
    history_len: int = 64
    ffn_mult: int = 4
    compact_dim: int = 64
    branches: str = "separate"
    global_read: bool = True
    gate_evidence: str = "contrast"
    anchor_feature: bool = True
    ln_eps: float = 1e-5
    decisions: str = "walk"
    kernels: str = "torch"

    def __post_init__(self) -> None:
        checks = {
            "d_sel": isinstance(self.d_sel, int) and self.d_sel >= 8,
            "heads": isinstance(self.heads, int) and self.heads >= 1 and self.d_sel % max(self.heads, 1) == 0,
            "read_dim": isinstance(self.read_dim, int) and self.read_dim >= 1 and self.read_dim % max(self.heads, 1) == 0,
            "global_blocks": isinstance(self.global_blocks, int) and self.global_blocks >= 0,
            "history_len": isinstance(self.history_len, int) and self.history_len >= 0,
            "ffn_mult": isinstance(self.ffn_mult, int) and self.ffn_mult >= 1,
            "compact_dim": isinstance(self.compact_dim, int) and self.compact_dim >= 1,
            "branches": self.branches in ("separate", "shared"),
            "global_read": isinstance(self.global_read, bool),
            "gate_evidence": self.gate_evidence in ("contrast", "slot"),
            "anchor_feature": isinstance(self.anchor_feature, bool),
            "ln_eps": isinstance(self.ln_eps, float) and 0.0 < self.ln_eps < 1e-2,
            "decisions": self.decisions in ("walk", "passes"),
            "kernels": self.kernels in ("torch", "triton"),
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise DRelayError(f"invalid drelay selector config: bad value for {', '.join(bad)}")

    # What a saved config that predates a key was trained with (`from_saved` fills these in).
    BEFORE_KEY = {"gate_evidence": "slot", "anchor_feature": False, "branches": "shared"}

    @property
    def read_head_dim(self) -> int:
        """d_g, the head width of the candidate, history and prefix reads."""
        return self.read_dim // self.heads

    @property
    def compact_width(self) -> int:
        """Width of the compact pre-activations: both branches side by side when separate."""
        return self.compact_dim * (2 if self.branches == "separate" else 1)

    @property
    def features_needed(self) -> int:
        """How many of the newest verified target features the selector reads: the history read's
        N, and at least the anchor's own feature when `anchor_feature` is on."""
        return max(self.history_len, int(self.anchor_feature))

    def to_dict(self) -> dict:
        """JSON-able dict (round-trips through `from_dict`)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict | None) -> "DRelayConfig":
        """Build from a (possibly partial) dict; unknown keys are a one-line DRelayError."""
        data = dict(data or {})
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise DRelayError(f"drelay selector config has unknown keys: {', '.join(unknown)}")
        if "ln_eps" in data and isinstance(data["ln_eps"], int):
            data["ln_eps"] = float(data["ln_eps"])
        return cls(**data)

    @classmethod
    def from_saved(cls, data: dict | None) -> "DRelayConfig":
        """A config stored in a checkpoint: keys it predates take the value it was trained with
        (`BEFORE_KEY`), not today's default, so older checkpoints load and decide as before."""
        return cls.from_dict({**cls.BEFORE_KEY, **(data or {})})
