"""GPU timing on Qwen3-4B-shaped layers: verify(1) vs verify(16), and AR vs speculative.

    python benchmarks/gpu_timing.py [--device cuda] [--layers 8] [--out outputs/gpu_check/timing.txt]
    python benchmarks/gpu_timing.py --device cpu --scale tiny      (the same code at test size)

A random-weight target with Qwen3-4B's config (benchmarks/gpu/common.py QWEN3_4B: vocabulary
151,936, width 2,560, 32/8 heads × head_dim 128, MLP 9,728, tied head) and fewer layers (--layers),
bf16, and the paper's 5-layer drafter (platform/experiments/qwen3-4b/train.yaml) on feature layers
spread over those. verify(G) = one target forward over G new tokens per row after a 512-token
prefill (what the engine pays per round); AR vs speculative = the engine end to end with the
untrained drafter (speedup then reflects overhead and verify cost, not acceptance).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.gpu.common import QWEN3_4B, QWEN3_TINY, paper_setting, random_qwen3_target  # noqa: E402
from drelay_model.decoding import GenerationConfig, SpeculativeEngine  # noqa: E402
from drelay_model.drafter import BlockDrafter, DrafterConfig  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def verify_ms(target, batch: int, G: int, reps: int = 20) -> float:
    dev = target.device
    prompt = torch.randint(0, target.vocab_size, (batch, 512), device=dev)
    cache = target.new_cache(batch, 512 + G + 1)
    with torch.inference_mode():
        target(prompt, cache)
        new = torch.randint(0, target.vocab_size, (batch, G), device=dev)
        for _ in range(3):
            target(new, cache)
            cache.crop(torch.full((batch,), 512, device=dev))
        _sync(dev)
        t0 = time.perf_counter()
        for _ in range(reps):
            target(new, cache)
            cache.crop(torch.full((batch,), 512, device=dev))
        _sync(dev)
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--out", default="outputs/gpu_check/timing.txt")
    p.add_argument("--scale", choices=("full", "tiny"), default="full", help="tiny: QWEN3_TINY shapes, short runs (CPU)")
    args = p.parse_args()
    if args.layers < 2:
        p.error("--layers must be at least 2 (the drafter reads features below the last layer)")
    target = random_qwen3_target(
        QWEN3_4B if args.scale == "full" else QWEN3_TINY, layers=args.layers, device=args.device, dtype=torch.bfloat16
    )
    where = torch.cuda.get_device_name() if target.device.type == "cuda" else "cpu"
    lines = [f"target: {'Qwen3-4B' if args.scale == 'full' else 'test'}-shaped layers ({target.name}), bf16 on {where}"]
    for batch in (1, 8):
        v1, v16 = verify_ms(target, batch, 1), verify_ms(target, batch, 16)
        lines.append(f"verify batch {batch}: G=1 {v1:.2f} ms, G=16 {v16:.2f} ms, ratio {v16 / v1:.2f}")
    torch.manual_seed(0)
    paper = paper_setting()["drafter"]
    features = tuple(
        sorted(
            {round(i * (args.layers - 2) / (len(paper["target_layer_ids"]) - 1)) for i in range(len(paper["target_layer_ids"]))}
        )
    )
    config = DrafterConfig.for_target(target, num_layers=paper["num_layers"], target_layer_ids=features)
    drafter = BlockDrafter(config, target).to(device=target.device, dtype=torch.bfloat16)
    lines.append(f"drafter: {paper['num_layers']} layers on target layers {features}")
    prompts = [torch.randint(0, target.vocab_size, (256,)).tolist() for _ in range(4)]
    cfg = GenerationConfig(max_new_tokens=128)
    for name, engine in (
        ("AR", SpeculativeEngine(target)),
        ("speculative (native, untrained drafter)", SpeculativeEngine(target, drafter)),
    ):
        engine.generate(prompts[:1], GenerationConfig(max_new_tokens=8))  # warm-up
        _sync(target.device)
        res = engine.generate(prompts, cfg)
        s = res.stats
        lines.append(f"{name}: {s.generated / s.time_total:.1f} tokens/s, tau {s.tau:.2f}, {s.time_total:.2f} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
