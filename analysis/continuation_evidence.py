"""DRelay §3.2 on the bundled drafter: do later draft predictions support the right candidate?

Replays greedy decoding with native (DFlash) selection over the target's own continuations, keeps the
rounds whose first error is covered by the pool and whose next `--span` drafts are all correct, and
for each pool candidate at the error lets the frozen target score the drafted suffix
(`drelay_model.diagnostics.continuation_scores_per_suffix`: the real and the control suffix share one
prefill of the prefix). Accuracy = how often the best-scoring candidate is
the target's token; the control is "a suffix from another prompt": the next qualifying round, in
order, drawn from a different prompt (`other_prompt_controls`). The paper reports 46/86 (DFlash)
real-suffix accuracy, +53.5 points over the control, on Qwen3-4B.

Prompts are taken `--chunk` at a time (in `load_benchmark`'s order for `--limit`) until a benchmark
has `--min-samples` qualifying rounds or its `--limit` prompts are used. The target's greedy
continuations are cached under --cache (one JSON line per prompt), so a rerun continues where an
interrupted one stopped.

Run:  .venv/bin/python analysis/continuation_evidence.py --benchmarks gsm8k,humaneval,mt_bench \
          --limit 400 --min-samples 50 --max-new-tokens 512
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
from drelay_model.diagnostics import (  # noqa: E402
    ContinuationEvidence,
    continuation_samples,
    continuation_scores_per_suffix,
    other_prompt_controls,
    pad_rounds,
    supported_is_correct,
)
from cli import guarded  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--checkpoint", default=None, help="drafter checkpoint (default: the bundled one)")
    p.add_argument("--benchmarks", default="gsm8k,mt_bench")
    p.add_argument("--limit", type=int, default=8, help="most prompts per benchmark")
    p.add_argument("--min-samples", type=int, default=None, help="stop adding prompts once this many rounds qualify")
    p.add_argument("--chunk", type=int, default=16, help="prompts decoded and replayed at a time")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--span", type=int, default=4, help="suffix length scored by the target")
    p.add_argument("--cache", default=str(REPO / "outputs" / "continuation_evidence"), help="greedy continuations, per benchmark")
    p.add_argument("--out", default=str(REPO / "outputs" / "continuation_evidence.json"))
    p.add_argument("--no-mlflow", action="store_true")
    args = p.parse_args(argv)
    if min(args.limit, args.max_new_tokens, args.span, args.chunk, args.min_samples or 1) < 1:
        p.error("--limit, --min-samples, --chunk, --max-new-tokens and --span must be positive")
    return args


def collect(
    target, drafter, prompts, conts, span: int, *, first_row: int = 0
) -> list[tuple[int, list[int], torch.Tensor, int, list[int]]]:
    """(prompt index, verified prefix, pool at the error [K], target token, drafted suffix) per
    qualifying round; prompt indices start at `first_row`."""
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
        out.append((first_row + r.row, prefix, cand[n, a], int(ref[n, a]), path[n, a + 1 : a + 1 + span].tolist()))
    return out


def cached_continuations(path: Path, prompts: list[list[int]], target, max_new_tokens: int) -> list[list[int]]:
    """The target's greedy continuation of each prompt, from `path` (JSON lines {prompt, tokens}) where
    it holds them, else decoded and appended."""
    known = {}
    if path.exists():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            known[tuple(rec["prompt"])] = rec["tokens"]
    todo = [p for p in prompts if tuple(p) not in known]
    if todo:
        outs = SpeculativeEngine(target).generate(todo, GenerationConfig(max_new_tokens=max_new_tokens)).tokens
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            for p, toks in zip(todo, outs):
                known[tuple(p)] = list(toks)
                f.write(json.dumps({"prompt": p, "tokens": list(toks)}) + "\n")
    return [known[tuple(p)] for p in prompts]


def benchmark_samples(args, target, drafter, encoder, bench: str) -> tuple[list, int]:
    """Qualifying rounds of `bench`, adding prompts `--chunk` at a time; → (samples, prompts used)."""
    from pipelines.data.eval_sets import load_benchmark

    prompts = [encoder.encode(p.turns[:1], []) for p in load_benchmark(bench, limit=args.limit)]
    cache = Path(args.cache) / f"{bench}-{args.max_new_tokens}.jsonl"
    samples, used = [], 0
    while used < len(prompts) and (args.min_samples is None or len(samples) < args.min_samples):
        chunk = prompts[used : used + args.chunk]
        conts = cached_continuations(cache, chunk, target, args.max_new_tokens)
        samples += collect(target, drafter, chunk, conts, args.span, first_row=used)
        used += len(chunk)
        print(f"[{bench}] {used} prompts, {len(samples)} qualifying rounds", flush=True)
    return samples, used


def score(target, samples) -> ContinuationEvidence:
    """Real against other-prompt control suffixes; samples with no other prompt are left out."""
    controls = other_prompt_controls([s[0] for s in samples])
    ev = ContinuationEvidence()
    for (_, prefix, cands, y, suffix), c in zip(tqdm(samples), controls):
        if c is None:
            continue
        real_scores, control_scores = continuation_scores_per_suffix(target, prefix, cands, [suffix, samples[c][4]])
        real, ctrl = supported_is_correct(real_scores, cands, y), supported_is_correct(control_scores, cands, y)
        ev = ev + ContinuationEvidence(samples=1, real_correct=int(real), control_correct=int(ctrl))
    return ev


def main(argv=None) -> int:
    args = parse_args(argv)
    from pipelines.common.methods import load_method, load_target_spec, resolve_method
    from pipelines.eval.prompts import encoder_for

    target = load_target_spec(args.target)
    drafter, _ = load_method(resolve_method("native", target_spec=args.target, checkpoint=args.checkpoint), target)
    encoder, table, used = encoder_for(target), {}, {}
    for bench in args.benchmarks.split(","):
        samples, used[bench] = benchmark_samples(args, target, drafter, encoder, bench)
        table[bench] = score(target, samples)
    total = sum(table.values(), ContinuationEvidence())
    print(f"{'benchmark':<12}{'prompts':>8}{'samples':>8}{'real':>10}{'control':>10}{'lift (pp)':>11}")
    for name, ev in {**table, "all": total}.items():
        lift = 100 * (ev.real_accuracy - ev.control_accuracy)
        n = used.get(name, sum(used.values()))
        print(
            f"{name:<12}{n:>8}{ev.samples:>8}{ev.real_correct:>5}/{ev.samples:<4}{ev.control_correct:>5}/{ev.samples:<4}{lift:>11.1f}"
        )
    result = {
        k: {"prompts": used[k], "samples": v.samples, "real_correct": v.real_correct, "control_correct": v.control_correct}
        for k, v in table.items()
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": result}, indent=2))
    if not args.no_mlflow:
        from pipelines.common.tracking import tracked_run

        with tracked_run("drelay-benchmarks", run_name="continuation_evidence", params=vars(args)) as run:
            run.log_metrics(
                {"real_accuracy": total.real_accuracy, "control_accuracy": total.control_accuracy, "samples": total.samples}
            )
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main, "continuation_evidence"))
