"""Decoding: the batched speculative engine, its settings (`GenerationConfig`, the one decode-settings
type), verification rules and the accepted-prefix length, statistics (`DecodeStats`, mergeable and serialisable), greedy replay.

May import: torch, drelay_model.{target, drafter, selectors, kv_cache, errors}.
"""

from drelay_model.decoding.engine import GenerationResult, SpeculativeEngine
from drelay_model.decoding.generation import DEFAULT_MAX_NEW_TOKENS, GenerationConfig, SettingsError
from drelay_model.decoding.stats import DecodeStats
from drelay_model.decoding.replay import oracle_path, replay
from drelay_model.decoding.draws import RowDraws
from drelay_model.decoding.verify import accept, pick_tokens

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "oracle_path",
    "replay",
    "DecodeStats",
    "GenerationConfig",
    "GenerationResult",
    "RowDraws",
    "SettingsError",
    "SpeculativeEngine",
    "accept",
    "pick_tokens",
]
