"""`drelay data …`: data preparation jobs."""

from __future__ import annotations

import argparse
from pathlib import Path

from drelay_model.errors import DRelayError
from pipelines.corpora import DEFAULT_TRAIN_SOURCES, load_sharegpt, load_training_corpus
from pipelines.regenerate import record_key, regenerate
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
    p.add_argument("--shard", metavar="K/N", help="process every N-th conversation from the K-th (parallel processes, one file each)")
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
    base = REPO_ROOT / "data" / "regenerated" / args.target
    out, done_elsewhere = Path(args.out) if args.out else base.with_suffix(".jsonl"), set()
    if args.shard:
        k, n = _parse_shard(args.shard)
        conversations = conversations[k::n]
        out = Path(args.out) if args.out else base.parent / f"{args.target}.shard-{k}-of-{n}.jsonl"
        # Skip what any sibling file (the unsharded run, other shard layouts) already holds.
        for sibling in sorted(base.parent.glob(f"{args.target}*.jsonl")):
            if sibling.resolve() != out.resolve():
                done_elsewhere |= read_done_ids(sibling)
    target = load_target_spec(args.target)
    summary = regenerate(
        target, conversations, out, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, done_elsewhere=done_elsewhere
    )
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


def read_done_ids(path: Path) -> set[str]:
    """Keys (`record_key`) in a regenerated file (read-only: a torn last line is ignored, not cut)."""
    import json

    ids = set()
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                ids.add(record_key(json.loads(line)))
            except (json.JSONDecodeError, KeyError):
                break
    return ids
