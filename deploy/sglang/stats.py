"""SGLang's per-request speculative statistics, by the names SGLang 0.5.23 writes into `meta_info`
(`srt/managers/tokenizer_manager.py`, `_calculate_spec_decoding_metrics`; checked against that
source by tests/sglang_cpu). No sglang import."""

from __future__ import annotations

VERIFY_CT = "spec_verify_ct"  # verification rounds
HISTOGRAM = "spec_correct_drafts_histogram"  # [n] = rounds that accepted exactly n drafts
ACCEPT_RATE = "spec_accept_rate"  # correct drafts / proposed drafts (no bonus token)
NUM_CORRECT = "spec_num_correct_drafts"
SPEC_META_KEYS = (VERIFY_CT, HISTOGRAM, ACCEPT_RATE, NUM_CORRECT)


def spec_fields(meta: dict) -> dict:
    """meta_info → {verify_ct: int, accept_histogram: list[int], accept_rate: float,
    num_correct_drafts: int}; absent keys (a request that never verified) read as zero/empty."""
    return {
        "verify_ct": int(meta.get(VERIFY_CT) or 0),
        "accept_histogram": list(meta.get(HISTOGRAM) or []),
        "accept_rate": float(meta.get(ACCEPT_RATE) or 0.0),
        "num_correct_drafts": int(meta.get(NUM_CORRECT) or 0),
    }
