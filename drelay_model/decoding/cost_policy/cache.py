"""The cost policy's round costs, cached per machine: measured once (`measure.py`), then read.

One JSON file per (target architecture and dtype, drafter architecture, selector and its size, torch
threads, device and its processor model, and the CPU kernels that take effect: packed linears or not
and what the drafter runs below float32, `CpuKernels.active(...).cache_tag()`; never a path: see
`cost_key`) under $DRELAY_CACHE_DIR/costs/ (default ~/.cache/drelay/costs/), holding the surface over the batch
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
import json
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


def cost_key(target, drafter, selector, *, method: str) -> dict:
    """What a round's costs depend on, as plain JSON values, and nothing else: no file paths, so two
    copies of one checkpoint (or two checkouts of one commit) share a surface, while a drafter of
    another width or depth, another selector head or another target architecture gets its own.

    target    its architecture (model type, heads) and every parameter's name, shape and dtype;
    drafter   its config (block size, layers, widths, draft vocabulary, ...) and parameter shapes;
    selector  the method, its class and parameter shapes (trained values do not change the cost);
    machine   device, processor model, torch threads and the CPU kernels that take effect."""
    device = str(target.embed_weight.device.type)
    kernels = drafter.cpu_kernels.active(device, target.dtype)
    drafter_config = {k: v for k, v in dataclasses.asdict(drafter.config).items() if k != "target"}
    return {
        "target": {
            "model_type": target.config.model_type,
            "heads": [target.n_heads, target.n_kv_heads, target.head_dim],  # the shapes below fix the rest
            "dtype": str(target.dtype),
            "parameters": _shapes(target.hf),
        },
        "drafter": {"config": drafter_config, "parameters": _shapes(drafter)},
        "selector": {"method": method, "class": type(selector).__name__, "parameters": _shapes(selector)},
        "machine": {
            "device": device,
            "processor": processor_model(device),
            "threads": torch.get_num_threads(),
            "kernels": kernels.cache_tag(),
        },
    }


def _shapes(module) -> list[str]:
    """'name dtype shape' of each parameter of `module` ([] for None), in registration order."""
    if module is None:
        return []
    return [f"{name} {p.dtype} {tuple(p.shape)}" for name, p in module.named_parameters()]


def costs_path(target, drafter, selector, *, method: str) -> Path:
    """The cache file of the surface of `target` with `drafter` and `selector` (the method `method`):
    named by `cost_key`'s digest, after a readable prefix (architecture, method, threads, device and
    the CPU kernel tag, since drafting and verification costs differ by them)."""
    key = cost_key(target, drafter, selector, method=method)
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    machine = key["machine"]
    arch = f"{target.config.model_type}-{target.num_layers}x{target.hidden_size}"
    name = f"{arch}__{method}__{digest}__t{machine['threads']}__{machine['device']}{machine['kernels']}.json"
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
    remeasure: bool = False,
    reps: int = 9,
    max_batch: int = DEFAULT_MAX_BATCH,
) -> RoundCosts:
    """The cached cost surface over batch sizes 1 … max_batch, measured (and cached) on first use,
    when stale or too narrow, or when `remeasure` (the median of up to `reps` interleaved
    repetitions per term, within `MEASURE_BUDGET_S`). The key: `costs_path`; `target_spec` names the
    target in messages only."""
    path = costs_path(target, drafter, selector, method=method)
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
