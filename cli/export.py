"""`drelay export --format {sglang,vllm} CHECKPOINT OUT`: a drafter checkpoint as a draft-model
directory for a serving framework: `sglang`, loaded by the SGLang plugin (`deploy/sglang/export.py`,
docs/sglang.md); `vllm`, vLLM's own DFlash format (`deploy/vllm/export.py`, docs/vllm.md)."""

from __future__ import annotations

import argparse

FORMATS = ("sglang", "vllm")


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="export a drafter checkpoint for a serving framework", description=__doc__)
    p.add_argument("--format", required=True, choices=FORMATS, help="output format")
    p.add_argument("--target", default="smollm2-135m",
                   help="vllm: the target the drafter runs on (checked; its LM-head rows become a draft vocabulary's head)")  # fmt: skip
    p.add_argument("--context-length", type=int, default=None,
                   help="sglang (required): the target's context length, its config's max_position_embeddings (40960 for Qwen3-4B/8B)")  # fmt: skip
    p.add_argument("checkpoint", help="drafter checkpoint directory, or models:/<name>@<alias>")
    p.add_argument("out", help="new (or empty) output directory")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from drelay_model.errors import DRelayError
    from pipelines.common.registry import resolve_checkpoint

    if args.format == "sglang" and args.context_length is None:
        raise DRelayError("--context-length: --format sglang needs the target's context length (its max_position_embeddings)")
    checkpoint = resolve_checkpoint(args.checkpoint)
    if args.format == "vllm":
        from deploy.vllm.export import ARCHITECTURE, export_vllm
        from drelay_model.target import load_target

        path = export_vllm(checkpoint, args.out, target=load_target(args.target, pack=False))
    else:
        from deploy.sglang.export import ARCHITECTURE, export_sglang

        path = export_sglang(checkpoint, args.out, context_length=args.context_length)
    print(f"exported {args.checkpoint} → {path} ({ARCHITECTURE})")
    return 0
