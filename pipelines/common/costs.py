"""Measured round costs for cost-aware verification length, cached per machine.

One JSON file per (target, checkpoint, method, torch threads, device and its processor model,
packed linears or not, and on CPU what the drafter runs below float32: `cpu_linear.draft_precisions`)
under $DRELAY_CACHE_DIR/costs/ (default ~/.cache/drelay/costs/): measuring takes a few seconds on
the CPU default, and the costs belong to the machine, not to the repository (a home directory
shared by cluster nodes of different CPU or GPU models keeps one file per model). `drelay costs`
re-measures.
"""

from __future__ import annotations

import hashlib
import platform
import sys
from pathlib import Path

import torch

from drelay_model.decoding.verify_costs import COSTS_VERSION, VerifyCosts, measure_costs
from drelay_model.kernels import cpu_linear
from drelay_model.target.loading import cache_root
from pipelines.common.methods import MethodSpec


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


def costs_path(target_spec: str, spec: MethodSpec, device: str = "cpu", *, packed: bool = False) -> Path:
    ckpt = str(Path(spec.checkpoint).resolve()) if spec.checkpoint else "random-drafter"
    digest = hashlib.sha1(ckpt.encode()).hexdigest()[:10]
    chip = hashlib.sha1(processor_model(device).encode()).hexdigest()[:6]
    low = "".join(f"-{p}" for p in cpu_linear.draft_precisions()) if device == "cpu" else ""  # drafting costs differ by it
    name = f"{target_spec}__{digest}__{spec.name}__t{torch.get_num_threads()}__{device}-{chip}{'-packed' if packed else ''}{low}.json"
    return cache_root() / "costs" / name.replace("/", "_")


def verify_costs(
    target, drafter, selector, *, target_spec: str, spec: MethodSpec, remeasure: bool = False, reps: int = 9
) -> VerifyCosts:
    """The cached cost curve, measured (and cached) on first use or when `remeasure` (the median of
    `reps` interleaved repetitions per term)."""
    device = str(target.embed_weight.device.type)
    path = costs_path(target_spec, spec, device, packed=getattr(target, "packed", False))
    if path.exists() and not remeasure:
        costs = VerifyCosts.load(path)
        if costs.version >= COSTS_VERSION:
            return costs
        print(
            f"the cached costs at {path} predate what is measured now (version {costs.version} < {COSTS_VERSION}): re-measuring",
            file=sys.stderr,
        )
    print(f"measuring verification costs once for {target_spec}/{spec.name} (cached at {path})", file=sys.stderr)
    costs = measure_costs(target, drafter, selector, reps=reps)
    costs.save(path)
    return costs
