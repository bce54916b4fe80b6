"""Flags and flag parsing shared by several commands (this module is not a command).

Values are checked here only as far as the command line goes (lists, integers, flag names in
messages); what a value means is checked where it is used: decode settings by `GenerationConfig`,
methods by `pipelines.common.methods`, benchmark names by `pipelines.data.eval_sets`.
"""

from __future__ import annotations

import argparse

from drelay_model.decoding import DEFAULT_MAX_NEW_TOKENS, GenerationConfig, SettingsError
from drelay_model.errors import DRelayError
from pipelines.common.engines import DEFAULT_VERIFY_LENGTH, VERIFY_LENGTHS
from pipelines.common.intervals import DEFAULT_RESAMPLES, DEFAULT_SEED
from pipelines.data.eval_sets import BENCHMARKS

DEFAULT_TARGET = "smollm2-135m"
_FLAGS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "seed": "--seed"}


def add_target(p: argparse.ArgumentParser) -> None:
    """--target, --device, --dtype: which target, where it runs and in which precision."""
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"target spec (default: {DEFAULT_TARGET})")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA when present (default)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the target's weights (default float32; bfloat16 is a different target numerically)")  # fmt: skip


def add_max_new_tokens(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=DEFAULT_MAX_NEW_TOKENS,
        help=f"per prompt or turn (default: {DEFAULT_MAX_NEW_TOKENS})",
    )


def add_verify_length(p: argparse.ArgumentParser) -> None:
    """--verify-length (generate, eval): how many drafts each round verifies (`pipelines.common.engines`)."""
    p.add_argument("--verify-length", choices=VERIFY_LENGTHS, default=DEFAULT_VERIFY_LENGTH,
                   help="cost: each round verifies as many drafts as pays off on this machine (0 = an AR step; "
                        "costs measured once and cached, see `drelay costs`); fixed: the whole path (the paper's "
                        f"setting). Default: {DEFAULT_VERIFY_LENGTH}")  # fmt: skip


def add_threads(p: argparse.ArgumentParser) -> None:
    """--threads (generate, eval, compare): the engine's CPU thread policy (`drelay_model.kernels.threads`)."""
    p.add_argument("--threads", default="auto", metavar="auto|N",
                   help="torch threads for decoding: auto (default) runs on the cores other processes leave "
                        "free, re-measured as it decodes; N: a fixed count")  # fmt: skip


def thread_policy(value: str):
    """A ThreadPolicy from --threads; a bad value is one line naming the flag."""
    from drelay_model.kernels.threads import ThreadPolicy

    try:
        return ThreadPolicy.parse(value)
    except DRelayError as exc:
        raise DRelayError(f"--{exc}") from None


def add_benchmark_set(p: argparse.ArgumentParser) -> None:
    """--benchmarks, --limit, --subset-seed, --data-dir (eval, compare)."""
    p.add_argument("--benchmarks", default="all", help=f"'all' or a comma list of {', '.join(BENCHMARKS)}")
    p.add_argument("--limit", type=int, help="seeded subset of N prompts per benchmark (default: all)")
    p.add_argument("--subset-seed", type=int, default=0, help="seed of the --limit subset")
    p.add_argument("--data-dir", help="benchmark directory with the data/benchmarks layout")


def add_run_outputs(p: argparse.ArgumentParser, *, kind: str, experiment: str) -> None:
    """--run-name, --out, --experiment, --no-mlflow, --no-progress (eval, compare)."""
    p.add_argument("--run-name", help="MLflow run name and default --out folder (default: derived from the settings)")
    p.add_argument("--out", help=f"output folder (default: outputs/{kind}/<run-name>); rerun with the same one to resume")
    p.add_argument("--experiment", default=experiment, help=f"MLflow experiment (default: {experiment})")
    p.add_argument("--no-mlflow", action="store_true", help="write files only")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")


def add_bootstrap_options(p: argparse.ArgumentParser) -> None:
    """--bootstrap-resamples, --bootstrap-seed: the 95% intervals' bootstrap (`pipelines.common.intervals`)."""
    p.add_argument(
        "--bootstrap-resamples",
        type=int,
        default=DEFAULT_RESAMPLES,
        metavar="R",
        help=f"bootstrap resamples behind each 95%% interval (default: {DEFAULT_RESAMPLES}; at least 100)",
    )
    p.add_argument(
        "--bootstrap-seed",
        type=int,
        default=DEFAULT_SEED,
        metavar="SEED",
        help=f"seed of the bootstrap resampling: same seed, same intervals (default: {DEFAULT_SEED})",
    )


def bootstrap_options(args: argparse.Namespace) -> dict[str, int]:
    """`{"resamples": R, "seed": SEED}` from the flags of `add_bootstrap_options`, ready to pass as keyword
    arguments to `pipelines.common.intervals`; a bad value is one line naming the flag."""
    if args.bootstrap_resamples < 100:
        raise DRelayError(f"--bootstrap-resamples must be ≥ 100, got {args.bootstrap_resamples}")
    if args.bootstrap_seed < 0:
        raise DRelayError(f"--bootstrap-seed must be ≥ 0, got {args.bootstrap_seed}")
    return {"resamples": args.bootstrap_resamples, "seed": args.bootstrap_seed}


def decode_config(
    max_new_tokens: int, temperature: float = 0.0, seed: int = 0, *, draft_sampling: bool = True
) -> GenerationConfig:
    """A GenerationConfig from flags; its one-line errors name the flag, not the field."""
    try:
        return GenerationConfig(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, draft_sampling=draft_sampling)
    except SettingsError as exc:
        raise DRelayError(f"{_FLAGS.get(exc.field, exc.field)} {exc.detail}") from None


def check_limit(limit: int | None) -> None:
    if limit is not None and limit < 1:
        raise DRelayError(f"--limit must be ≥ 1, got {limit}")


def split_list(text: str, flag: str) -> list[str]:
    """A comma list, deduplicated in order; empty items are an error."""
    items = [t.strip() for t in text.split(",")]
    if not items or any(not t for t in items):
        raise DRelayError(f"{flag}: expected a comma-separated list, got {text!r}")
    return list(dict.fromkeys(items))


def parse_ints(text: str, flag: str, *, minimum: int) -> tuple[int, ...]:
    try:
        values = tuple(int(t) for t in split_list(text, flag))
    except ValueError:
        raise DRelayError(f"{flag}: expected integers, got {text!r}") from None
    if min(values) < minimum:
        raise DRelayError(f"{flag}: values must be ≥ {minimum}, got {text!r}")
    return values
