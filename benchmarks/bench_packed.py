"""Each phase of a speculative round with oneDNN-packed linears on and off.

On the bundled drafter and the SmolLM2 target, batch 1, fp32, a ~200-token cached context: the AR
step (target forward of 1 token), verification of 2, 4 and 16 tokens, the draft (drafter block
forward + head + top-K), and each selector's select. Within every repetition the two settings
alternate (the order flips each repetition) and every figure is a median over repetitions of the
best of 3 calls, so a busy machine slows both alike; the ratio packed ÷ eager is printed per phase.
The two settings are two stacks of the same weights (`CpuKernels(packed=True / False)`).
Packing does not change any output: the script checks that the argmax of every verify and each
slot's native candidate of the draft agree between the settings, and counts the pool members that
differ (where the packed drafter ranks its pool coarsely, bf16 or int8, a member tied at the K-th
place may differ: `BlockDrafter.pool`).

Run:  .venv/bin/python benchmarks/bench_packed.py [--threads 1] [--reps 8]
Results go to --out (JSON) and MLflow (experiment `drelay-benchmarks`) unless --no-mlflow.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from drelay_model.kernels.cpu_linear import CpuKernels  # noqa: E402
from drelay_model.selectors import SelectionContext  # noqa: E402
from cli import guarded  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--methods", default="native,drelay")
    p.add_argument("--context", type=int, default=200, help="cached context tokens")
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--out", default=str(REPO / "outputs" / "bench_packed.json"))
    p.add_argument("--no-mlflow", action="store_true")
    return p.parse_args(argv)


def best_of(fn, n: int = 3) -> float:
    """ms of the fastest of n calls (after one untimed call)."""
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return min(times)


def shared_context(target, drafter, args) -> dict:
    """One random cached context (target cache, drafter context, history, a drafted block) that both
    stacks time on, as the packed stack builds it: the settings then differ only in the phases."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 5000, (1, args.context), generator=g)
    cache, ctx = target.new_cache(1, args.context + 64), drafter.new_context_cache(1, args.context + 64)
    res = target(ids, cache, feature_layers=drafter.config.target_layer_ids)
    drafter.extend_context(res.features, ctx)
    anchor, history = ids[:, -1], res.features[:, -64:]
    sctx = SelectionContext(anchor_ids=anchor, anchor_pos=cache.lengths.clone(), row_ids=torch.zeros(1, dtype=torch.long),
                            history=history, history_mask=torch.ones(history.shape[:2], dtype=torch.bool))  # fmt: skip
    return {"cache": cache, "L": cache.lengths.clone(), "ctx": ctx, "anchor": anchor, "sctx": sctx,
            "block": drafter.draft(anchor, ctx), "block_ids": torch.randint(100, 5000, (1, 16), generator=g)}  # fmt: skip


def phases_of(target, methods: dict, shared: dict) -> tuple[dict, tuple]:
    """The timed phases of one stack (a target and its methods' drafters and selectors, all under
    the target's CPU kernel settings) on the shared context, and (verify-16 argmax, the pool)."""
    drafter = next(iter(methods.values()))[0]
    cache, ctx, anchor = shared["cache"], shared["ctx"], shared["anchor"]

    def verify(T):
        def run():
            out = target(shared["block_ids"][:, :T], cache).logits
            cache.crop(shared["L"])
            return out

        return run

    phases = {"ar_step": verify(1), "verify_2": verify(2), "verify_4": verify(4), "verify_16": verify(16),
              "draft": lambda: drafter.draft(anchor, ctx)}  # fmt: skip
    for m, (_, selector) in methods.items():
        phases[f"select_{m}"] = lambda s=selector: s.select(shared["block"], shared["sctx"])
    return phases, (verify(16)().argmax(-1), drafter.draft(anchor, ctx).cand_ids)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from drelay_model.target import load_target
    from pipelines.common.methods import load_method, resolve_method

    stacks, shared = {}, None
    for on in (True, False):  # the same weights under packed (True) and eager (False) settings
        target = load_target(args.target, cpu_kernels=CpuKernels(packed=on))
        if on and not target.packed:
            print("error: this target was not packed (not CPU float32, or no oneDNN)", file=sys.stderr)
            return 1
        methods = {m: load_method(resolve_method(m, target_spec=args.target), target) for m in args.methods.split(",")}
        shared = shared or shared_context(target, next(iter(methods.values()))[0], args)
        stacks[on] = phases_of(target, methods, shared)
    (v_on, pool_on), (v_off, pool_off) = stacks[True][1], stacks[False][1]
    same = torch.equal(v_on, v_off) and torch.equal(pool_on[..., 0], pool_off[..., 0])  # same outputs either way
    members = int((~(pool_on[..., :, None] == pool_off[..., None, :]).any(-1)).sum())  # packed members not in the eager pool
    phases = stacks[True][0]
    times: dict[str, dict[bool, list[float]]] = {p: {True: [], False: []} for p in phases}
    with torch.inference_mode():
        for rep in range(args.reps):
            for on in (True, False) if rep % 2 else (False, True):
                for name, fn in stacks[on][0].items():
                    times[name][on].append(best_of(fn))
    table = {p: {"eager_ms": statistics.median(t[False]), "packed_ms": statistics.median(t[True])} for p, t in times.items()}
    for row in table.values():
        row["ratio"] = row["packed_ms"] / row["eager_ms"]
    for key in ("eager_ms", "packed_ms"):
        table["verify_16_over_ar"] = table.get("verify_16_over_ar", {}) | {key: table["verify_16"][key] / table["ar_step"][key]}
    print(
        f"{'phase':<20}{'eager ms':>10}{'packed ms':>11}{'packed÷eager':>14}   (outputs identical: {same}; pool members differing: {members})"
    )
    for name, row in table.items():
        ratio = f"{row['ratio']:>14.2f}" if "ratio" in row else f"{'(÷ ar_step)':>14}"
        print(f"{name:<20}{row['eager_ms']:>10.2f}{row['packed_ms']:>11.2f}{ratio}")
    out = {"args": vars(args), "table": table, "outputs_identical": same, "pool_members_differing": members}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    if not args.no_mlflow:
        from pipelines.common.tracking import tracked_run

        with tracked_run(
            "drelay-benchmarks", run_name="bench_packed", params={k: v for k, v in vars(args).items() if k != "out"}
        ) as run:
            run.log_metrics({f"{p}_{k}": v for p, row in table.items() for k, v in row.items()})
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(guarded(main, Path(__file__).name))
