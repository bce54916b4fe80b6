"""DRelay: Global Read + Causal Selector (prefix-aware repair of parallel drafts).

May import: torch, drelay_model.selectors.base, drelay_model.drafter, drelay_model.training.losses.
"""

from drelay_model.selectors.drelay.causal import TIE_TOL, CausalSelector, Evidence, decide
from drelay_model.selectors.drelay.config import DRelayConfig
from drelay_model.selectors.drelay.global_read import GlobalFeatures, GlobalRead, null_attention
from drelay_model.selectors.drelay.selector import DRelaySelector, SelectionTrace, SelectorOutput

__all__ = [
    "TIE_TOL",
    "CausalSelector",
    "DRelayConfig",
    "DRelaySelector",
    "Evidence",
    "GlobalFeatures",
    "GlobalRead",
    "SelectionTrace",
    "SelectorOutput",
    "decide",
    "null_attention",
]
