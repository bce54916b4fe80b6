"""`drelay data …`: data preparation jobs."""

from __future__ import annotations

import argparse

from drelay_model.errors import DRelayError
from pipelines.corpora import DEFAULT_TRAIN_SOURCES, load_sharegpt, load_training_corpus
from pipelines.regenerate import regenerate
from pipelines.resolve import REPO_ROOT, load_target_spec


def add_parser(sub) -> None:
    data = sub.add_parser("data", help="data preparation")
    jobs = data.add_subparsers(dest="job", required=True, metavar="JOB")
    p = jobs.add_parser("regenerate", help="replace assistant turns by the target's own greedy generations (resumable)")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--sources", default=",".join(DEFAULT_TRAIN_SOURCES), help="comma-separated corpus names")
    p.add_argument("--sharegpt", metavar="FILE", help="a ShareGPT-style JSON/JSONL file instead of the built-in corpus")
    p.add_argument("--out", help="output JSONL (default: data/regenerated/<target>.jsonl)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--limit", type=int, help="only the first N conversations (smoke runs)")
    p.set_defaults(run=run_regenerate)


def run_regenerate(args: argparse.Namespace) -> int:
    if args.limit is not None and args.limit < 1:
        raise DRelayError(f"--limit must be ≥ 1, got {args.limit}")
    if args.sharegpt:
        conversations = load_sharegpt(args.sharegpt)
    else:
        conversations = load_training_corpus([s.strip() for s in args.sources.split(",") if s.strip()])
    if args.limit:
        conversations = conversations[: args.limit]
    out = args.out or REPO_ROOT / "data" / "regenerated" / f"{args.target}.jsonl"
    target = load_target_spec(args.target)
    summary = regenerate(target, conversations, out, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens)
    print(
        f"regenerated {summary.generated} conversations ({summary.done_before} already done, "
        f"{summary.skipped_too_long} skipped as too long), {summary.tokens} tokens in {summary.seconds:.0f} s → {out}"
    )
    return 0
