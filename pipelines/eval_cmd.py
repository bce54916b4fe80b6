"""`drelay eval`: τ, speedup S and pool diagnostics on the eight benchmarks, tracked in MLflow.

Everything a user can get wrong (names, numbers, checkpoints, prompt files) is checked before any
model loads, and first-turn prompt lengths before decoding or any MLflow run starts; errors are one
line (exit 2) and leave no run behind.
Results of finished (benchmark, method) cells are kept in `--out`, so rerunning the same command
resumes. See docs/evaluation.md.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from drelay_model.errors import DRelayError
from pipelines.benchmarks import BENCHMARKS, BenchmarkPrompt, load_benchmark
from pipelines.eval_prompts import encoder_for
from pipelines.eval_results import CellStore
from pipelines.eval_session import run_session
from pipelines.evaluate import EvalConfig, Evaluation, MethodUnderTest
from pipelines.cluster.paths import ensure_writable_dir, local_dir, resolve_path
from pipelines.cluster.registry import resolve_checkpoint
from pipelines.resolve import AR, bundled_checkpoint, load_method, load_target_spec, method_names

DEFAULT_EXPERIMENT = "drelay-eval"


def add_parser(sub) -> None:
    """Register `drelay eval` and its companion `drelay report`."""
    from pipelines import report_cmd

    p = sub.add_parser("eval", help="evaluate methods on the benchmarks (τ, speedup, diagnostics; MLflow)", description=__doc__)
    p.add_argument("--target", default="smollm2-135m", help="target spec (default: smollm2-135m)")
    p.add_argument("--methods", default=f"{AR},native", help=f"comma list of {', '.join(method_names())}; 'ar' is always run")
    p.add_argument("--checkpoint", action="append", default=[], metavar="DIR|METHOD=DIR",
                   help="drafter checkpoint for all methods, or per method (repeatable)")  # fmt: skip
    p.add_argument("--random-drafter", action="store_true", help="untrained drafter: smoke runs only (τ ≈ 1)")
    p.add_argument("--benchmarks", default="all", help=f"'all' or a comma list of {', '.join(BENCHMARKS)}")
    p.add_argument("--limit", type=int, help="seeded subset of N prompts per benchmark (default: all)")
    p.add_argument("--subset-seed", type=int, default=0, help="seed of the --limit subset")
    p.add_argument("--data-dir", help="benchmark directory with the data/benchmarks layout")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (with replay diagnostics); 1 = sampling")
    p.add_argument("--seeds", default="0", help="comma list; at T > 0 results are mean ± std over seeds")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--concurrency", default="1", help="comma list of simultaneous requests; the first gives τ and S")
    p.add_argument("--no-diagnostics", action="store_true", help="skip greedy replay (replay τ, oracle τ, coverage)")
    p.add_argument("--run-name", help="MLflow run name and default --out folder (default: derived from the settings)")
    p.add_argument("--out", help="output folder (default: outputs/eval/<run-name>); rerun with the same one to resume")
    p.add_argument("--experiment", default=DEFAULT_EXPERIMENT, help=f"MLflow experiment (default: {DEFAULT_EXPERIMENT})")
    p.add_argument("--no-mlflow", action="store_true", help="write files only")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.set_defaults(run=run)
    report_cmd.add_parser(sub)


# ---- argument checking (no model loads) ------------------------------------------------------------


def _split(text: str, flag: str) -> list[str]:
    items = [t.strip() for t in text.split(",")]
    if not items or any(not t for t in items):
        raise DRelayError(f"{flag}: expected a comma-separated list, got {text!r}")
    return list(dict.fromkeys(items))


def _ints(text: str, flag: str, *, minimum: int) -> tuple[int, ...]:
    try:
        values = tuple(int(t) for t in _split(text, flag))
    except ValueError:
        raise DRelayError(f"{flag}: expected integers, got {text!r}") from None
    if min(values) < minimum:
        raise DRelayError(f"{flag}: values must be ≥ {minimum}, got {text!r}")
    return values


def parse_methods(text: str) -> tuple[str, ...]:
    names = _split(text, "--methods")
    known = method_names()
    for n in names:
        if n not in known:
            raise DRelayError(f"unknown method '{n}' (choose from: {', '.join(known)})")
    return (AR, *[n for n in names if n != AR])


def parse_benchmarks(text: str) -> tuple[str, ...]:
    if text.strip() == "all":
        return BENCHMARKS
    names = _split(text, "--benchmarks")
    for n in names:
        if n not in BENCHMARKS:
            raise DRelayError(f"unknown benchmark '{n}' (choose from: all, {', '.join(BENCHMARKS)})")
    return tuple(b for b in BENCHMARKS if b in names)  # the paper's order


def parse_checkpoints(values: list[str], methods: tuple[str, ...], *, target: str, random_drafter: bool) -> dict[str, str | None]:
    """method → checkpoint dir (None for AR): per-method `METHOD=DIR`, else a shared DIR, else bundled."""
    shared, per = None, {}
    for v in values:
        name, eq, path = v.partition("=")
        if eq and not Path(v).is_dir():
            if name not in method_names() or name == AR:
                raise DRelayError(f"--checkpoint {v}: '{name}' is not a speculative method (choose from: {', '.join(method_names()[1:])})")
            if name not in methods:
                raise DRelayError(f"--checkpoint {v}: method '{name}' is not in --methods")
            per[name] = path
        elif shared is not None:
            raise DRelayError("--checkpoint: give one shared DIR, or METHOD=DIR per method")
        else:
            shared = v
    if random_drafter and (shared or per):
        raise DRelayError("--random-drafter and --checkpoint exclude each other")
    out: dict[str, str | None] = {AR: None}
    for m in methods[1:]:
        path = resolve_checkpoint(per.get(m) or shared or (None if random_drafter else _bundled(target)) or "") or None
        if path is None and not random_drafter:
            raise DRelayError(f"method '{m}' needs a drafter checkpoint: none is bundled for target '{target}'; "
                              "pass --checkpoint DIR (or --random-drafter for a smoke run)")  # fmt: skip
        if path is not None and not Path(path).is_dir():
            raise DRelayError(f"checkpoint '{path}' not found (method '{m}')")
        out[m] = path
    return out


def _bundled(target: str) -> str | None:
    path = bundled_checkpoint(target)
    return str(path) if path else None


def check_budget(max_new_tokens: int, limit: int | None) -> None:
    """--max-new-tokens and --limit, shared with `drelay compare`."""
    if max_new_tokens < 1:
        raise DRelayError(f"--max-new-tokens must be ≥ 1, got {max_new_tokens}")
    if limit is not None and limit < 1:
        raise DRelayError(f"--limit must be ≥ 1, got {limit}")


def build_config(args: argparse.Namespace) -> EvalConfig:
    check_budget(args.max_new_tokens, args.limit)
    if not 0 <= args.temperature <= 100:
        raise DRelayError(f"--temperature must be in [0, 100], got {args.temperature}")
    methods = parse_methods(args.methods)
    return EvalConfig(
        target=args.target, methods=methods, benchmarks=parse_benchmarks(args.benchmarks),
        temperature=args.temperature, seeds=_ints(args.seeds, "--seeds", minimum=0), max_new_tokens=args.max_new_tokens,
        concurrency=_ints(args.concurrency, "--concurrency", minimum=1), limit=args.limit, subset_seed=args.subset_seed,
        checkpoints=parse_checkpoints(args.checkpoint, methods, target=args.target, random_drafter=args.random_drafter),
        random_drafter=args.random_drafter, data_dir=args.data_dir, diagnostics=not args.no_diagnostics,
    )  # fmt: skip


def default_run_name(c: EvalConfig) -> str:
    """Derived from the settings, so rerunning the same command resumes the same evaluation."""
    target = re.sub(r"[^A-Za-z0-9._+-]+", "_", Path(c.target).name or c.target)
    name = f"{target}-{'+'.join(c.methods)}-T{c.temperature:g}-{c.max_new_tokens}tok"
    return name + (f"-n{c.limit}" if c.limit else "") + ("-random" if c.random_drafter else "")


# ---- loading ---------------------------------------------------------------------------------------


def load_prompts(c: EvalConfig) -> dict[str, list[BenchmarkPrompt]]:
    return {b: load_benchmark(b, limit=c.limit, seed=c.subset_seed, data_dir=c.data_dir) for b in c.benchmarks}


def load_methods(c: EvalConfig, target) -> dict[str, MethodUnderTest]:
    out = {}
    for m in c.methods:
        drafter, selector = load_method(m, target, target_spec=c.target, checkpoint=c.checkpoints.get(m), random_drafter=c.random_drafter)
        out[m] = MethodUnderTest(m, drafter, selector)
    return out


@contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """Turn SIGTERM into SystemExit while evaluating, so tracked runs end FAILED, not RUNNING."""
    def handler(signum, frame):  # noqa: ARG001
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(args: argparse.Namespace) -> int:
    config = build_config(args)
    run_name = args.run_name or default_run_name(config)
    if any(q in run_name for q in "'\"`"):
        raise DRelayError(f"--run-name must not contain quotes, got {run_name!r}")
    out_dir = local_dir(resolve_path(args.out or f"outputs/eval/{run_name}"), "--out")
    ensure_writable_dir(out_dir, "--out", create=False)
    prompts = load_prompts(config)
    target = load_target_spec(config.target)
    evaluation = Evaluation(
        config, target, load_methods(config, target), prompts, encoder_for(target), CellStore(out_dir), progress=not args.no_progress
    )
    evaluation.check_prompt_lengths()
    with sigterm_as_exit(), ExitStack() as stack:
        summary = run_session(evaluation, run_name=run_name, out_dir=out_dir, experiment=None if args.no_mlflow else args.experiment, stack=stack)
    print(summary.text)
    for line in summary.warnings:
        print(f"drelay: warning: {line}", file=sys.stderr)
    return 0
