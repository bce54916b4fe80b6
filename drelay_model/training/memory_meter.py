"""Measured peak of tensor allocations on any device, from torch's profiler memory events.

Every allocation and free of a tensor's storage made while profiling is a `[memory]` event with a
signed byte count; the running sum from the start of the window is the live tensor memory the
window added, and its maximum is the peak. Tensors that existed before the window are not counted.
Works on CPU (no allocator statistics there); on CUDA `torch.cuda.max_memory_allocated` agrees.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile


def measure_peak_bytes(fn: Callable[[], object]) -> tuple[int, object]:
    """Run fn() and return (peak bytes of tensors allocated during it above the start, fn's result)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, profile_memory=True) as prof:
        result = fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak, result
