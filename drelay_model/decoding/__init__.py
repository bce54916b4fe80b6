"""Decoding: the batched speculative engine, verification rules, statistics, and greedy replay."""

from drelay_model.decoding.engine import GenerationConfig, GenerationResult, SpeculativeEngine
from drelay_model.decoding.stats import DecodeStats
from drelay_model.decoding.replay import oracle_path, replay
from drelay_model.decoding.verify import accept, pick_tokens

__all__ = ["oracle_path", "replay", "DecodeStats", "GenerationConfig", "GenerationResult", "SpeculativeEngine", "accept", "pick_tokens"]
