"""`drelay snapshot carry DIR` / `drelay snapshot restore DIR`: a long run's snapshot
(`train.snapshot_dir`) carried to a fresh machine in git history, with the tree left as it was
(pipelines/train/snapshot_history.py, docs/training.md).

    drelay snapshot carry checkpoints/training/smollm2-135m-long     # at a stop: two commits
    drelay snapshot restore checkpoints/training/smollm2-135m-long   # on a fresh clone (training does it by itself)

`carry` commits the snapshot, then takes it out of the index in a second commit (the files stay on
disk); it needs an index with nothing else staged. Once per stop: every carry adds the snapshot's
bytes to the history. `restore` writes the newest carried snapshot into DIR when DIR holds none."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("snapshot", help="carry a training snapshot to a fresh machine in git history", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    carry = actions.add_parser("carry", help="commit DIR's snapshot into history and take it out of the tree again")
    carry.add_argument("dir", help="the run's train.snapshot_dir")
    restore = actions.add_parser("restore", help="write the newest carried snapshot into DIR when it holds none")
    restore.add_argument("dir", help="the run's train.snapshot_dir")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from drelay_model.errors import DRelayError
    from pipelines.common.paths import repo_path
    from pipelines.train import snapshot_history

    path = Path(repo_path(args.dir))
    if args.action == "carry":
        holder, head = snapshot_history.carry(path)
        print(f"carried {args.dir} in commit {holder[:12]}; HEAD {head[:12]} has it out of the tree again")
        return 0
    found = snapshot_history.restore(path)
    if found is None:
        from pipelines.train.snapshot import has_snapshot

        if has_snapshot(path):
            print(f"{args.dir} already holds a snapshot: nothing restored")
            return 0
        raise DRelayError(f"snapshot restore: no commit in this repository's history holds a snapshot in '{args.dir}'")
    commit, meta = found
    print(
        f"restored the snapshot of run {meta.get('run_name')} at step {meta.get('step')} from commit {commit[:12]} into {args.dir}"
    )
    return 0
