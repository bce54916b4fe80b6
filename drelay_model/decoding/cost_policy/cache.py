"""The cost policy's round costs, cached per machine: measured once (`measure.py`), then read.

One JSON file per (target, checkpoint, method, torch threads, device and its processor model, and
the CPU kernels that take effect: packed linears or not and what the drafter runs below float32,
`CpuKernels.active(...).cache_tag()`)
under $DRELAY_CACHE_DIR/costs/ (default ~/.cache/drelay/costs/), holding the surface over the batch
sizes 1 … max_batch (`surface_batches`): measuring takes about `MEASURE_BUDGET_S` + one repetition
(docs/verification-length.md has today's figure on the CPU default), and the costs belong to the
machine, not to the repository (a home directory shared by cluster nodes of different CPU or GPU
models keeps one file per model). A file of an older version, or one whose surface stops below the
max_batch asked for, is measured again; `drelay costs` re-measures. So is a file measured while
other processes kept more than `BUSY_CORES` of the CPU busy (its `busy_cores`, from /proc/stat as the
thread policy reads it): costs taken under contention can be ten times a quiet machine's and would
steer every later round (one such file kept the bundled DRelay head from drafting on the demo prompt).
"""

from __future__ import annotations

import dataclasses
import hashlib
import platform
import sys
import time
from pathlib import Path

import torch

from drelay_model.decoding.cost_policy.measure import measure_costs
from drelay_model.decoding.cost_policy.surface import RoundCosts, StaleCosts, surface_batches
from drelay_model.kernels.threads import CpuSample
from drelay_model.target.loading import cache_root


def processor_model(device: str) -> str:
    """The CPU's model name (Linux /proc/cpuinfo; `platform.processor()` elsewhere) or the GPU's."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def costs_path(target, drafter, *, target_spec: str, method: str, checkpoint: str | None) -> Path:
    """The cache file of the surface of `target` (loaded from `target_spec`) with `drafter` (loaded
    from `checkpoint`; None: a random drafter) and the selector `method`. The CPU kernel settings
    enter the name as they take effect there (the drafter's, which it takes from the target unless
    given its own: `CpuKernels.active(...).cache_tag()`), since drafting and verification costs
    differ by them."""
    device = str(target.embed_weight.device.type)
    kernels = drafter.cpu_kernels.active(device, target.dtype)
    ckpt = str(Path(checkpoint).resolve()) if checkpoint else "random-drafter"
    digest = hashlib.sha1(ckpt.encode()).hexdigest()[:10]
    chip = hashlib.sha1(processor_model(device).encode()).hexdigest()[:6]
    name = f"{target_spec}__{digest}__{method}__t{torch.get_num_threads()}__{device}-{chip}{kernels.cache_tag()}.json"
    return cache_root() / "costs" / name.replace("/", "_")


MEASURE_BUDGET_S = 20.0  # measuring stops after the first repetition that ends this long after the warm-up began
DEFAULT_MAX_BATCH = 16  # the batch sizes measured when the caller names none (the serve default)


BUSY_CORES = 0.5  # a surface measured beside more of other processes' CPU use than this is measured again


def cached_costs(
    target,
    drafter,
    selector,
    *,
    target_spec: str,
    method: str,
    checkpoint: str | None,
    remeasure: bool = False,
    reps: int = 9,
    max_batch: int = DEFAULT_MAX_BATCH,
) -> RoundCosts:
    """The cached cost surface over batch sizes 1 … max_batch, measured (and cached) on first use,
    when stale or too narrow, or when `remeasure` (the median of up to `reps` interleaved
    repetitions per term, within `MEASURE_BUDGET_S`). The key: `costs_path`."""
    path = costs_path(target, drafter, target_spec=target_spec, method=method, checkpoint=checkpoint)
    if path.exists() and not remeasure:
        try:
            costs = RoundCosts.load(path)
            if costs.busy_cores > BUSY_CORES:
                print(f"the cached costs at {path} were measured while other processes used {costs.busy_cores:.1f} cores:"
                      " re-measuring", file=sys.stderr)  # fmt: skip
            elif costs.max_batch >= max_batch:
                return costs
            else:
                print(f"the cached costs at {path} stop at batch {costs.max_batch} < {max_batch}: re-measuring", file=sys.stderr)
        except StaleCosts as exc:
            print(f"{exc}: re-measuring", file=sys.stderr)
    batches = surface_batches(max_batch)
    print(
        f"measuring verification costs once for {target_spec}/{method} at batch sizes {', '.join(map(str, batches))}"
        f" (≤ {MEASURE_BUDGET_S:.0f} s + one repetition; cached at {path})",
        file=sys.stderr,
    )
    t0, before = time.perf_counter(), CpuSample.now()
    costs = measure_costs(target, drafter, selector, batch_sizes=batches, reps=reps, budget_s=MEASURE_BUDGET_S)
    after = CpuSample.now()
    busy = round(max(after.others_since(before), 0.0), 3) if before is not None and after is not None else 0.0
    costs = dataclasses.replace(costs, busy_cores=busy)
    costs.save(path)
    note = f"; other processes used {busy:.1f} cores meanwhile: measured again next time" if busy > BUSY_CORES else ""
    print(f"measured in {time.perf_counter() - t0:.1f} s{note}", file=sys.stderr)
    return costs
