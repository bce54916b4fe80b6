"""The DFlash-style block drafter: config, model, checkpoints, draft vocabulary.

May import: torch, safetensors, drelay_model.{kv_cache, atomic, errors}.
"""

from drelay_model.drafter.checkpoint import load_drafter, read_checkpoint, save_drafter
from drelay_model.drafter.config import DrafterConfig, TargetFingerprint
from drelay_model.drafter.draft_vocab import build_draft_vocab, draft_vocab_coverage
from drelay_model.drafter.model import BlockDrafter, DraftBlock

__all__ = [
    "BlockDrafter",
    "DraftBlock",
    "DrafterConfig",
    "TargetFingerprint",
    "build_draft_vocab",
    "draft_vocab_coverage",
    "load_drafter",
    "read_checkpoint",
    "save_drafter",
]
