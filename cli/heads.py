"""`drelay heads add SRC CHECKPOINT` / `drelay heads list CHECKPOINT`: more trained selector heads
beside a drafter checkpoint's own, so that `--method <selector>` decodes with them
(`drelay_model/drafter/heads.py`, docs/selectors.md).

    drelay heads add outputs/train/smollm2-135m-stage-dflash2/drafter checkpoints/smollm2-135m
    drelay generate --chat "…" --method dflash2        # the bundled drafter with that DFlash-2 head

SRC is a checkpoint of the same drafter, bit for bit (a selector-stage run's export), holding a
trained head; it lands in CHECKPOINT/heads/<selector>.safetensors (replacing an earlier one)."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("heads", help="add or list trained selector heads beside a checkpoint's own", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    add = actions.add_parser("add", help="copy SRC's trained head into CHECKPOINT/heads/")
    add.add_argument("src", help="checkpoint directory holding the head (same drafter as CHECKPOINT)")
    add.add_argument("checkpoint", help="the drafter checkpoint that gains the head")
    show = actions.add_parser("list", help="the checkpoint's own selector and its extra heads")
    show.add_argument("checkpoint", help="drafter checkpoint directory")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from drelay_model.drafter.checkpoint import read_checkpoint
    from drelay_model.drafter.heads import add_head, head_names

    if args.action == "add":
        name, path = add_head(args.src, args.checkpoint)
        print(f"added the '{name}' head of {args.src} → {path} (decode with --method {name})")
        return 0
    _, _, meta = read_checkpoint(args.checkpoint)
    own = (meta.get("selector") or {}).get("name") or "native"
    print(f"{args.checkpoint}: own selector {own}; heads: {', '.join(head_names(args.checkpoint)) or 'none'}")
    return 0
