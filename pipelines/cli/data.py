"""`drelay data …`: data preparation jobs (pipelines/data/)."""

from __future__ import annotations

import argparse

from drelay_model.errors import DRelayError
from pipelines.cli.options import add_max_new_tokens, check_limit, decode_config
from pipelines.data.corpora import DEFAULT_TRAIN_SOURCES, load_sharegpt, load_training_corpus
from pipelines.data.regenerate import output_plan, regenerate
from pipelines.common.methods import load_target_spec


def add_parser(sub) -> None:
    data = sub.add_parser("data", help="data preparation")
    jobs = data.add_subparsers(dest="job", required=True, metavar="JOB")
    p = jobs.add_parser("regenerate", help="replace assistant turns by the target's own greedy generations (resumable)")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--sources", default=",".join(DEFAULT_TRAIN_SOURCES), help="comma-separated corpus names")
    p.add_argument("--sharegpt", metavar="FILE", help="a ShareGPT-style JSON/JSONL file instead of the built-in corpus")
    p.add_argument("--out", help="output JSONL (default: data/regenerated/<target>.jsonl)")
    p.add_argument("--batch-size", type=int, default=16)
    add_max_new_tokens(p)
    p.add_argument("--limit", type=int, help="only the first N conversations (smoke runs)")
    p.add_argument("--shard", metavar="K/N", help="process every N-th conversation from the K-th (parallel processes, one file each)")
    p.set_defaults(run=run_regenerate)


def run_regenerate(args: argparse.Namespace) -> int:
    check_limit(args.limit)
    decode = decode_config(args.max_new_tokens)
    shard = _parse_shard(args.shard) if args.shard else None
    if args.sharegpt:
        conversations = load_sharegpt(args.sharegpt)
    else:
        conversations = load_training_corpus([s.strip() for s in args.sources.split(",") if s.strip()])
    if args.limit:
        conversations = conversations[: args.limit]
    if shard is not None:
        conversations = conversations[shard[0] :: shard[1]]
    out, done_elsewhere = output_plan(args.target, args.out, shard)
    target = load_target_spec(args.target)
    summary = regenerate(target, conversations, out, batch_size=args.batch_size, decode=decode, done_elsewhere=done_elsewhere)
    print(
        f"regenerated {summary.generated} conversations ({summary.done_before} already done, "
        f"{summary.skipped_too_long} skipped as too long), {summary.tokens} tokens in {summary.seconds:.0f} s → {out}"
    )
    return 0


def _parse_shard(text: str) -> tuple[int, int]:
    k, _, n = text.partition("/")
    if not (k.isdigit() and n.isdigit()) or not 0 <= int(k) < int(n):
        raise DRelayError(f"--shard must be K/N with 0 ≤ K < N, got '{text}'")
    return int(k), int(n)
