"""`drelay eval`: τ, speedup S and pool diagnostics on the eight benchmarks, tracked in MLflow.

Everything a user can get wrong (names, numbers, checkpoints, prompt files) is checked before any
model loads, and first-turn prompt lengths before decoding or any MLflow run starts; errors are one
line (exit 2) and leave no run behind.
Results of finished (benchmark, method) cells are kept in `--out`, so rerunning the same command
resumes. See docs/evaluation.md.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import ExitStack
from pathlib import Path

from drelay_model.errors import DRelayError
from cli.options import (add_benchmark_set, add_bootstrap_options, add_max_new_tokens, add_run_outputs, add_target, add_threads,
                         add_verify_length, bootstrap_options, check_limit, decode_config, parse_ints, split_list,
                         thread_policy)  # fmt: skip
from pipelines.common.methods import AR, NATIVE, MethodSpec, check_method, load_target_spec, method_names, resolve_method
from pipelines.common.outputs import ensure_writable_dir, local_dir, resolve_path
from pipelines.common.signals import sigterm_as_exit
from pipelines.data.eval_sets import load_benchmarks, parse_benchmarks
from pipelines.eval.prompts import encoder_for
from pipelines.eval.results import cell_store
from pipelines.eval.runner import EvalConfig, Evaluation, MethodUnderTest
from pipelines.eval.session import DEFAULT_EXPERIMENT, run_session
from pipelines.eval.timing import TIMINGS


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="evaluate methods on the benchmarks (τ, speedup, diagnostics; MLflow)", description=__doc__)
    add_target(p)
    p.add_argument("--methods", default=f"{AR},{NATIVE}", help=f"comma list of {', '.join(method_names())}; '{AR}' is always run")
    p.add_argument("--checkpoint", action="append", default=[], metavar="DIR|METHOD=DIR",
                   help="drafter checkpoint for all methods, or per method (repeatable)")  # fmt: skip
    p.add_argument("--random-drafter", action="store_true", help="untrained drafter: smoke runs only (τ ≈ 1)")
    add_benchmark_set(p)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (with replay diagnostics); 1 = sampling")
    p.add_argument("--seeds", default="0", help="comma list; at T > 0 results are mean ± std over seeds")
    p.add_argument("--match-rule", action="store_true",
                   help="T > 0: verify the argmax path and accept drafts equal to the target's samples "
                        "(the match rule), not sample the path and accept with min(1, p/q)")  # fmt: skip
    add_max_new_tokens(p)
    add_verify_length(p)
    add_threads(p)
    p.add_argument("--concurrency", default="1", help="comma list of simultaneous requests; the first gives τ and S")
    p.add_argument("--no-diagnostics", action="store_true", help="skip greedy replay (replay τ, oracle τ, coverage)")
    p.add_argument("--timing", choices=TIMINGS, default="paired",
                   help="paired (default): AR re-decodes each prompt back to back with the method, S = the method's "
                        "tokens/s ÷ AR's, each pooled over those prompt-turns; phased: S from AR's own cell (half the "
                        "AR time, but other load can skew it)")  # fmt: skip
    add_bootstrap_options(p)
    add_run_outputs(p, kind="eval", experiment=DEFAULT_EXPERIMENT)
    p.set_defaults(run=run)


def parse_methods(text: str) -> tuple[str, ...]:
    names = [check_method(n) for n in split_list(text, "--methods")]
    return (AR, *[n for n in names if n != AR])


def resolve_specs(values: list[str], methods: tuple[str, ...], *, target: str, random_drafter: bool) -> tuple[MethodSpec, ...]:
    """One MethodSpec per method: `--checkpoint METHOD=DIR` for that method, else a shared DIR, else bundled."""
    shared, per = None, {}
    for v in values:
        name, eq, path = v.partition("=")
        if eq and not Path(v).is_dir():
            if name not in method_names() or name == AR:
                raise DRelayError(
                    f"--checkpoint {v}: '{name}' is not a speculative method (choose from: {', '.join(method_names()[1:])})"
                )
            if name not in methods:
                raise DRelayError(f"--checkpoint {v}: method '{name}' is not in --methods")
            per[name] = path
        elif shared is not None:
            raise DRelayError("--checkpoint: give one shared DIR, or METHOD=DIR per method")
        else:
            shared = v
    if random_drafter and (shared or per):
        raise DRelayError("--random-drafter and --checkpoint exclude each other")
    hint = "pass --checkpoint DIR (or --random-drafter for a smoke run)"
    return tuple(resolve_method(m, target_spec=target, checkpoint=per.get(m) or shared, random_drafter=random_drafter, hint=hint)
                 for m in methods)  # fmt: skip


def build_config(args: argparse.Namespace) -> EvalConfig:
    decode = decode_config(args.max_new_tokens, args.temperature, draft_sampling=not args.match_rule)
    check_limit(args.limit)
    methods = parse_methods(args.methods)
    return EvalConfig(
        target=args.target, specs=resolve_specs(args.checkpoint, methods, target=args.target, random_drafter=args.random_drafter),
        benchmarks=parse_benchmarks(args.benchmarks), decode=decode, seeds=parse_ints(args.seeds, "--seeds", minimum=0),
        concurrency=parse_ints(args.concurrency, "--concurrency", minimum=1), limit=args.limit, subset_seed=args.subset_seed,
        data_dir=args.data_dir, diagnostics=not args.no_diagnostics, timing=args.timing, verify_length=args.verify_length,
        threads=thread_policy(args.threads).describe_setting(),
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    config = build_config(args)
    bootstrap = bootstrap_options(args)
    run_name = args.run_name or config.default_run_name()
    if any(q in run_name for q in "'\"`"):
        raise DRelayError(f"--run-name must not contain quotes, got {run_name!r}")
    out_dir = local_dir(resolve_path(args.out or f"outputs/eval/{run_name}"), "--out")
    ensure_writable_dir(out_dir, "--out", create=False)
    prompts = load_benchmarks(config.benchmarks, limit=config.limit, seed=config.subset_seed, data_dir=config.data_dir)
    target = load_target_spec(config.target, device=args.device, dtype=args.dtype)
    methods = {s.name: MethodUnderTest.load(s, target) for s in config.specs}
    evaluation = Evaluation(
        config, target, methods, prompts, encoder_for(target), cell_store(out_dir), progress=not args.no_progress
    )
    evaluation.check_prompt_lengths()
    with sigterm_as_exit(), ExitStack() as stack:
        summary = run_session(
            evaluation,
            run_name=run_name,
            out_dir=out_dir,
            experiment=None if args.no_mlflow else args.experiment,
            stack=stack,
            bootstrap=bootstrap,
        )
    print(summary.text)
    for line in summary.warnings:
        print(f"drelay: warning: {line}", file=sys.stderr)
    return 0
