"""`drelay export --format {sglang,vllm} [--target T] CHECKPOINT OUT`: a drafter checkpoint as a draft-model
directory for a serving framework: `sglang`, loaded by the SGLang plugin (`deploy/sglang/export.py`,
docs/sglang.md), carrying the target's context length; `vllm`, vLLM's own DFlash format
(`deploy/vllm/export.py`, docs/vllm.md)."""

from __future__ import annotations

import argparse

FORMATS = ("sglang", "vllm")


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="export a drafter checkpoint for a serving framework", description=__doc__)
    p.add_argument("--format", required=True, choices=FORMATS, help="output format")
    p.add_argument("--target", default="smollm2-135m",
                   help="the target the drafter runs on (checked against the checkpoint; vllm: its LM-head rows become a draft "
                        "vocabulary's head; sglang: its config gives the context length)")  # fmt: skip
    p.add_argument("--context-length", type=int, default=None,
                   help="sglang: the context length the export carries (default: the target's max_position_embeddings, "
                        "40960 for Qwen3-4B/8B; at most that)")  # fmt: skip
    p.add_argument("checkpoint", help="drafter checkpoint directory, or models:/<name>@<alias>")
    p.add_argument("out", help="new (or empty) output directory")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pipelines.common.checkpoint_refs import resolve_ref

    checkpoint = resolve_ref(args.checkpoint)
    if args.format == "vllm":
        from deploy.vllm.export import ARCHITECTURE, export_vllm
        from drelay_model.target import load_target

        path = export_vllm(checkpoint, args.out, target=load_target(args.target, pack=False))
    else:
        from deploy.sglang.export import ARCHITECTURE, export_sglang
        from drelay_model.target.loading import load_target_config

        target_config = load_target_config(args.target)  # no weights: the architecture and context length
        path = export_sglang(checkpoint, args.out, context_length=args.context_length, target_config=target_config)
    print(f"exported {args.checkpoint} → {path} ({ARCHITECTURE})")
    return 0
