"""`drelay compare`: greedy replay τ of several drafter checkpoints on the benchmarks, side by side.

    drelay compare --variant native=outputs/train/A/drafter --variant drelay=outputs/train/B/drafter \\
                   [--variant drelay-native-pick=outputs/train/B/drafter:native] [--baseline native] \\
                   [--benchmarks all] [--limit 8] [--max-new-tokens 128]

The target decodes each benchmark's prompts once (AR, greedy; cached), then every variant is replayed
over those continuations (pipelines/compare.py). Prints the τ table with ratios to the baseline and
writes compare.md, compare.json and compare.png to --out (default outputs/compare/<run-name>); the
same land in one MLflow run. Rerunning the same command resumes: finished cells are loaded.
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import ExitStack
from dataclasses import dataclass

from drelay_model.errors import DRelayError

DEFAULT_EXPERIMENT = "drelay-compare"


def add_parser(sub) -> None:
    p = sub.add_parser("compare", help="replay τ of drafter checkpoints side by side (native vs DRelay, ablations)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--variant", action="append", default=[], metavar="LABEL=DIR[:SELECTOR]",
                   help="a checkpoint to compare (repeatable); SELECTOR defaults to the one it was trained with")  # fmt: skip
    p.add_argument("--baseline", help="label the ratios divide by (default: the first --variant)")
    p.add_argument("--target", default="smollm2-135m", help="target spec (default: smollm2-135m)")
    p.add_argument("--benchmarks", default="all", help="'all' or a comma list")
    p.add_argument("--limit", type=int, help="seeded subset of N prompts per benchmark (default: all)")
    p.add_argument("--subset-seed", type=int, default=0)
    p.add_argument("--data-dir", help="benchmark directory with the data/benchmarks layout")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--run-name", help="MLflow run name and default --out folder (default: derived from the settings)")
    p.add_argument("--out", help="output folder (default: outputs/compare/<run-name>); rerun with the same one to resume")
    p.add_argument("--experiment", default=DEFAULT_EXPERIMENT, help=f"MLflow experiment (default: {DEFAULT_EXPERIMENT})")
    p.add_argument("--no-mlflow", action="store_true", help="write files only")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.set_defaults(run=run)


@dataclass(frozen=True)
class CompareJob:
    """What one comparison does (the command line's options; `drelay study` builds one directly)."""

    variants: tuple[str, ...]  # "LABEL=DIR[:SELECTOR]"
    baseline: str | None = None
    target: str = "smollm2-135m"
    benchmarks: str = "all"
    limit: int | None = None
    subset_seed: int = 0
    data_dir: str | None = None
    max_new_tokens: int = 256
    run_name: str | None = None
    out: str | None = None
    experiment: str = DEFAULT_EXPERIMENT
    mlflow: bool = True
    progress: bool = True

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "CompareJob":
        return cls(variants=tuple(args.variant), baseline=args.baseline, target=args.target, benchmarks=args.benchmarks,
                   limit=args.limit, subset_seed=args.subset_seed, data_dir=args.data_dir, max_new_tokens=args.max_new_tokens,
                   run_name=args.run_name, out=args.out, experiment=args.experiment, mlflow=not args.no_mlflow,
                   progress=not args.no_progress)  # fmt: skip


def run(args: argparse.Namespace) -> int:
    return compare(CompareJob.from_args(args))


def compare(job: CompareJob) -> int:
    from pipelines.compare import ReplayStore, parse_variants, plot_comparison, replay_variants, summarize
    from pipelines.eval_cmd import check_budget, parse_benchmarks, sigterm_as_exit
    from pipelines.eval_prompts import encoder_for
    from pipelines.eval_results import CellStore
    from pipelines.evaluate import EvalConfig, Evaluation, MethodUnderTest
    from pipelines.benchmarks import load_benchmark
    from pipelines.cluster.paths import ensure_writable_dir, local_dir, resolve_path
    from pipelines.resolve import AR, load_target_spec

    check_budget(job.max_new_tokens, job.limit)
    variants, baseline = parse_variants(job.variants, job.baseline)
    benchmarks = parse_benchmarks(job.benchmarks)
    run_name = job.run_name or f"{job.target}-{'+'.join(v.label for v in variants)}-{job.max_new_tokens}tok" + (f"-n{job.limit}" if job.limit else "")
    if any(q in run_name for q in "'\"`/"):
        raise DRelayError(f"--run-name must not contain quotes or slashes, got {run_name!r}")
    out_dir = ensure_writable_dir(local_dir(resolve_path(job.out or f"outputs/compare/{run_name}"), "--out"), "--out", create=False)
    prompts = {b: load_benchmark(b, limit=job.limit, seed=job.subset_seed, data_dir=job.data_dir) for b in benchmarks}
    target = load_target_spec(job.target)
    encoder = encoder_for(target)
    progress = job.progress

    # 1. References: the target's greedy continuations (the AR cell of `drelay eval`, cached).
    config = EvalConfig(target=job.target, methods=(AR,), benchmarks=benchmarks, max_new_tokens=job.max_new_tokens,
                        limit=job.limit, subset_seed=job.subset_seed, data_dir=job.data_dir, diagnostics=False)  # fmt: skip
    evaluation = Evaluation(config, target, {AR: MethodUnderTest(AR, None, None)}, prompts, encoder, CellStore(out_dir), progress=progress)
    evaluation.check_prompt_lengths()
    with sigterm_as_exit(), ExitStack() as stack:
        ar_cells = {b: c for (b, _), c in evaluation.run().items()}
        # 2. Replay every variant over them.
        cells = replay_variants(target, job.target, variants, prompts, ar_cells, encoder, ReplayStore(out_dir), progress=progress)
        summary = summarize(cells, variants, benchmarks, baseline)
        n = sum(len(p) for p in prompts.values())
        title = f"{job.target}: greedy replay τ, {n} prompts over {len(benchmarks)} benchmarks, ≤ {job.max_new_tokens} new tokens"
        text = f"# {title}\n\n" + summary.markdown()
        out_dir.mkdir(parents=True, exist_ok=True)
        files = [out_dir / "compare.md", out_dir / "compare.json"]
        files[0].write_text(text)
        files[1].write_text(json.dumps({"baseline": baseline, "variants": [vars(v) for v in variants], "metrics": summary.metrics}, indent=1))
        plot = plot_comparison(summary, out_dir / "compare.png", title)
        if job.mlflow:
            _track(stack, job, run_name, variants, baseline, benchmarks, summary, [*files, plot])
    print(text)
    print(f"files: {out_dir}", file=sys.stderr)
    return 0


def _track(stack, job: CompareJob, run_name, variants, baseline, benchmarks, summary, files) -> None:
    """One MLflow run: params, `<variant>/<metric>` metrics, the table, JSON and plot as artifacts."""
    from pipelines.eval_session import connect
    from pipelines.run_tags import run_tags
    from pipelines.tracking import tracked_run

    client = connect(job.experiment, run_name)
    params = {"target": job.target, "benchmarks": ",".join(benchmarks), "limit": job.limit, "max_new_tokens": job.max_new_tokens,
              "baseline": baseline, **{f"variant.{v.label}": f"{v.checkpoint}:{v.selector}" for v in variants}}  # fmt: skip
    tags = run_tags("compare", target=job.target, method=",".join(v.label for v in variants))
    run = stack.enter_context(tracked_run(job.experiment, run_name=run_name, tags=tags, params=params, client=client))
    run.log_metrics({f"{v}/{k}": x for v, m in summary.metrics.items() for k, x in m.items()})
    for f in files:
        run.log_artifact(f)
    print(f"MLflow: run '{run_name}' ({run.run_id}) in experiment '{job.experiment}' at {client.tracking_uri}", file=sys.stderr)
