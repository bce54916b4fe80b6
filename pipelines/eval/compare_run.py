"""One comparison job end to end: AR references, replay of every variant, table, plot, MLflow run.

`drelay compare` builds a `CompareJob` from its flags; `drelay study` builds one from its spec. The
replay math and the summary live in pipelines/eval/compare.py.
"""

from __future__ import annotations

import json
import sys
from contextlib import ExitStack
from dataclasses import dataclass

from drelay_model.decoding import GenerationConfig
from drelay_model.errors import DRelayError
from pipelines.common.methods import AR, MethodSpec, load_target_spec
from pipelines.common.outputs import ensure_writable_dir, local_dir, resolve_path
from pipelines.common.intervals import DEFAULT_LEVEL, DEFAULT_RESAMPLES, DEFAULT_SEED, check_bootstrap_options
from pipelines.common.signals import sigterm_as_exit
from pipelines.data.eval_sets import load_benchmarks, parse_benchmarks
from pipelines.eval.compare import parse_variants, replay_store, replay_variants, select_cost, summarize
from pipelines.eval.compare_intervals import Bootstrap
from pipelines.eval.plots import plot_comparison
from pipelines.eval.prompts import encoder_for
from pipelines.eval.results import cell_store
from pipelines.eval.runner import EvalConfig, Evaluation, MethodUnderTest

DEFAULT_EXPERIMENT = "drelay-compare"


@dataclass(frozen=True)
class CompareJob:
    """What one comparison does. Replay is greedy, so `decode` sets only the token budget."""

    variants: tuple[str, ...]  # "LABEL=DIR[:SELECTOR]"
    baseline: str | None = None
    target: str = "smollm2-135m"
    device: str = "cpu"  # auto | cpu | cuda
    dtype: str = "float32"
    benchmarks: str = "all"
    limit: int | None = None
    subset_seed: int = 0
    data_dir: str | None = None
    decode: GenerationConfig = GenerationConfig()
    run_name: str | None = None
    out: str | None = None
    experiment: str = DEFAULT_EXPERIMENT
    mlflow: bool = True
    progress: bool = True
    parent_run_id: str | None = None  # nest the MLflow run under this run (a study's parent)
    bootstrap_resamples: int = DEFAULT_RESAMPLES  # behind every ratio's 95% interval
    bootstrap_seed: int = DEFAULT_SEED

    def __post_init__(self) -> None:
        if not self.decode.greedy:
            raise DRelayError("compare replays greedy decoding; temperature must be 0")
        if self.limit is not None and self.limit < 1:
            raise DRelayError(f"--limit must be ≥ 1, got {self.limit}")
        try:
            check_bootstrap_options(self.bootstrap_resamples, DEFAULT_LEVEL)
        except ValueError as exc:
            raise DRelayError(f"--bootstrap-resamples: {exc}") from None
        if not isinstance(self.bootstrap_seed, int) or self.bootstrap_seed < 0:
            raise DRelayError(f"--bootstrap-seed must be ≥ 0, got {self.bootstrap_seed!r}")

    @property
    def bootstrap(self) -> Bootstrap:
        return Bootstrap(self.bootstrap_resamples, self.bootstrap_seed)

    def default_run_name(self, labels: list[str]) -> str:
        return f"{self.target}-{'+'.join(labels)}-{self.decode.max_new_tokens}tok" + (f"-n{self.limit}" if self.limit else "")


def run_compare(job: CompareJob) -> int:
    variants, baseline = parse_variants(job.variants, job.baseline)
    benchmarks = parse_benchmarks(job.benchmarks)
    run_name = job.run_name or job.default_run_name([v.label for v in variants])
    if any(q in run_name for q in "'\"`/"):
        raise DRelayError(f"--run-name must not contain quotes or slashes, got {run_name!r}")
    out_dir = ensure_writable_dir(
        local_dir(resolve_path(job.out or f"outputs/compare/{run_name}"), "--out"), "--out", create=False
    )
    prompts = load_benchmarks(benchmarks, limit=job.limit, seed=job.subset_seed, data_dir=job.data_dir)
    target = load_target_spec(job.target, device=job.device, dtype=job.dtype)
    encoder = encoder_for(target)

    # 1. References: the target's greedy continuations (the AR cell of `drelay eval`, cached).
    config = EvalConfig(target=job.target, specs=(MethodSpec(AR),), benchmarks=benchmarks, decode=job.decode,
                        limit=job.limit, subset_seed=job.subset_seed, data_dir=job.data_dir, diagnostics=False)  # fmt: skip
    evaluation = Evaluation(
        config, target, {AR: MethodUnderTest(AR)}, prompts, encoder, cell_store(out_dir), progress=job.progress
    )
    evaluation.check_prompt_lengths()
    with sigterm_as_exit(), ExitStack() as stack:
        ar_cells = {b: c for (b, _), c in evaluation.run().items()}
        # 2. Replay every variant over them.
        cells = replay_variants(target, variants, prompts, ar_cells, encoder, replay_store(out_dir), progress=job.progress)
        # 3. What each selector costs to run (batch 1, one real block of the first prompt).
        first = encoder.encode(next(iter(prompts.values()))[0].turns[:1], [])
        costs = {v.label: select_cost(target, MethodUnderTest.load(v.spec, target, label=v.label), first) for v in variants}
        summary = summarize(cells, variants, benchmarks, baseline, costs, bootstrap=job.bootstrap)
        n = sum(len(p) for p in prompts.values())
        title = f"{job.target}: greedy replay τ, {n} prompts over {len(benchmarks)} benchmarks, ≤ {job.decode.max_new_tokens} new tokens"
        text = f"# {title}\n\n" + summary.markdown()
        out_dir.mkdir(parents=True, exist_ok=True)
        files = [out_dir / "compare.md", out_dir / "compare.json"]
        files[0].write_text(text)
        described = [{"label": v.label, "checkpoint": v.checkpoint, "selector": v.selector} for v in variants]
        files[1].write_text(json.dumps({"baseline": baseline, "variants": described, **summary.as_json()}, indent=1))
        plot = plot_comparison(summary, out_dir / "compare.png", title)
        if job.mlflow:
            _track(stack, job, run_name, variants, baseline, benchmarks, summary, [*files, plot])
    print(text)
    print(f"files: {out_dir}", file=sys.stderr)
    return 0


def _track(stack, job: CompareJob, run_name, variants, baseline, benchmarks, summary, files) -> None:
    """One MLflow run: params, `<variant>/<metric>` metrics, the table, JSON and plot as artifacts."""
    from pipelines.common.run_tags import run_tags
    from pipelines.common.tracking import attach, tracked_run
    from pipelines.eval.session import connect

    client = connect(job.experiment, run_name)
    params = {"target": job.target, "benchmarks": ",".join(benchmarks), "limit": job.limit, "max_new_tokens": job.decode.max_new_tokens,
              "baseline": baseline, "bootstrap_resamples": job.bootstrap_resamples, "bootstrap_seed": job.bootstrap_seed,
              **{f"variant.{v.label}": f"{v.checkpoint}:{v.selector}" for v in variants}}  # fmt: skip
    tags = run_tags("compare", target=job.target, method=",".join(v.label for v in variants))
    parent = attach(client, job.parent_run_id) if job.parent_run_id else None
    run = stack.enter_context(
        tracked_run(job.experiment, run_name=run_name, tags=tags, params=params, client=client, parent=parent)
    )
    run.log_metrics({f"{v}/{k}": x for v, m in summary.metrics.items() for k, x in m.items()})
    run.set_tags({f"verdict.{v}": iv.verdict for v, iv in summary.intervals.items()})  # ahead / behind / unresolved
    for f in files:
        run.log_artifact(f)
    print(f"MLflow: run '{run_name}' ({run.run_id}) in experiment '{job.experiment}' at {client.tracking_uri}", file=sys.stderr)
