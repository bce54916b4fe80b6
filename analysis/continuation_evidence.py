"""DRelay §3.2 on the bundled drafter: do later draft predictions support the right candidate?

Replays greedy decoding with native (DFlash) selection over the target's own continuations, keeps the
rounds whose first error is covered by the pool and whose next `--span` drafts are all correct, and
for each pool candidate at the error lets the frozen target score the drafted suffix
(`drelay_model.diagnostics.continuation_scores`). Accuracy = how often the best-scoring candidate is
the target's token; the control swaps in another sample's suffix. The paper reports 46/86 (DFlash)
real-suffix accuracy, +53.5 points over the control, on Qwen3-4B.

Run:  .venv/bin/python analysis/continuation_evidence.py --benchmarks gsm8k,mt_bench --limit 8
Results go to --out (JSON) and MLflow (experiment `drelay-benchmarks`) unless --no-mlflow.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from drelay_model.decoding import GenerationConfig, SpeculativeEngine, replay  # noqa: E402
from drelay_model.diagnostics import ContinuationEvidence, continuation_samples, continuation_scores, pad_rounds, supported_is_correct  # noqa: E402
from pipelines.cli import guarded  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--checkpoint", default=None, help="drafter checkpoint (default: the bundled one)")
    p.add_argument("--benchmarks", default="gsm8k,mt_bench")
    p.add_argument("--limit", type=int, default=8, help="prompts per benchmark")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--span", type=int, default=4, help="suffix length scored by the target")
    p.add_argument("--out", default=str(REPO / "outputs" / "continuation_evidence.json"))
    p.add_argument("--no-mlflow", action="store_true")
    args = p.parse_args(argv)
    if args.limit < 1 or args.max_new_tokens < 1 or args.span < 1:
        p.error("--limit, --max-new-tokens and --span must be positive")
    return args


def collect(target, drafter, prompts, conts, span: int) -> list[tuple[list[int], torch.Tensor, int, list[int]]]:
    """(verified prefix, pool at the error [K], target token, drafted suffix) per qualifying round."""
    rounds = []
    replay(target, drafter, prompts, conts, on_round=rounds.append)
    if not rounds:
        return []
    cand, path, ref = pad_rounds([(r.block.cand_ids[0], r.path, r.ref) for r in rounds])
    ok, A = continuation_samples(cand, path, ref, span)
    out = []
    for n in ok.nonzero()[:, 0].tolist():
        r, a = rounds[n], int(A[n])
        seq = prompts[r.row] + conts[r.row]
        prefix = seq[: r.anchor_pos + 1] + ref[n, :a].tolist()  # verified tokens through slot a − 1
        out.append((prefix, cand[n, a], int(ref[n, a]), path[n, a + 1 : a + 1 + span].tolist()))
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    from pipelines.common.methods import load_method, load_target_spec, resolve_method
    from pipelines.data.eval_sets import load_benchmark
    from pipelines.eval.prompts import encoder_for

    target = load_target_spec(args.target)
    drafter, _ = load_method(resolve_method("native", target_spec=args.target, checkpoint=args.checkpoint), target)
    encoder, table = encoder_for(target), {}
    for bench in args.benchmarks.split(","):
        prompts = [encoder.encode(p.turns[:1], []) for p in load_benchmark(bench, limit=args.limit)]
        conts = SpeculativeEngine(target).generate(prompts, GenerationConfig(max_new_tokens=args.max_new_tokens)).tokens
        samples = collect(target, drafter, prompts, conts, args.span)
        ev = ContinuationEvidence()
        for i, (prefix, cands, y, suffix) in enumerate(tqdm(samples, desc=bench)):
            control = samples[(i + 1) % len(samples)][3] if len(samples) > 1 else suffix
            real = supported_is_correct(continuation_scores(target, prefix, cands, suffix), cands, y)
            ctrl = supported_is_correct(continuation_scores(target, prefix, cands, control), cands, y)
            ev = ev + ContinuationEvidence(samples=1, real_correct=int(real), control_correct=int(ctrl))
        table[bench] = ev
    total = sum(table.values(), ContinuationEvidence())
    print(f"{'benchmark':<12}{'samples':>8}{'real':>10}{'control':>10}{'lift (pp)':>11}")
    for name, ev in {**table, "all": total}.items():
        lift = 100 * (ev.real_accuracy - ev.control_accuracy)
        print(f"{name:<12}{ev.samples:>8}{ev.real_correct:>5}/{ev.samples:<4}{ev.control_correct:>5}/{ev.samples:<4}{lift:>11.1f}")
    result = {k: {"samples": v.samples, "real_correct": v.real_correct, "control_correct": v.control_correct} for k, v in table.items()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": result}, indent=2))
    if not args.no_mlflow:
        from pipelines.common.tracking import tracked_run

        with tracked_run("drelay-benchmarks", run_name="continuation_evidence", params=vars(args)) as run:
            run.log_metrics({"real_accuracy": total.real_accuracy, "control_accuracy": total.control_accuracy, "samples": total.samples})
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main, "continuation_evidence"))
