"""`drelay export --format sglang CHECKPOINT OUT`: a drafter checkpoint as an HF-style draft-model
directory that the SGLang plugin loads (`deploy/sglang/export.py`; see docs/sglang.md)."""

from __future__ import annotations

import argparse

FORMATS = ("sglang",)


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="export a drafter checkpoint for a serving framework", description=__doc__)
    p.add_argument("--format", required=True, choices=FORMATS, help="output format")
    p.add_argument("checkpoint", help="drafter checkpoint directory, or models:/<name>@<alias>")
    p.add_argument("out", help="new (or empty) output directory")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from deploy.sglang.export import ARCHITECTURE, export_sglang
    from pipelines.common.registry import resolve_checkpoint

    path = export_sglang(resolve_checkpoint(args.checkpoint), args.out)
    print(f"exported {args.checkpoint} → {path} ({ARCHITECTURE})")
    return 0
