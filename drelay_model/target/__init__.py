"""The frozen target model: loading (`load_target`) and our lean cached forward (`TargetModel`).

May import: torch, transformers, safetensors, gguf, drelay_model.{kv_cache, atomic, errors}.
"""

from drelay_model.target.loading import SMOLLM2, TINY_SPECS, load_target, tiny_target
from drelay_model.target.model import TargetModel, TargetOutput

__all__ = ["SMOLLM2", "TINY_SPECS", "TargetModel", "TargetOutput", "load_target", "tiny_target"]
