"""`drelay import --format dflash SRC OUT`: a DFlash draft-model directory (z-lab's, SpecForge's, or
what vLLM loads) as our drafter checkpoint for the target, checked against it
(`deploy/dflash_import.py`, docs/import.md)."""

from __future__ import annotations

import argparse

from cli.options import DEFAULT_TARGET

FORMATS = ("dflash",)


def add_parser(sub) -> None:
    p = sub.add_parser("import", help="import a drafter from another format (a DFlash draft model)", description=__doc__)
    p.add_argument("--format", required=True, choices=FORMATS, help="input format")
    p.add_argument("--target", default=DEFAULT_TARGET,
                   help=f"the target the drafter runs on: its width, vocabulary, layers and head are checked (default: {DEFAULT_TARGET})")  # fmt: skip
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the target's weights as loaded for the check (bfloat16 halves a large target's memory; default float32)")  # fmt: skip
    p.add_argument("--top-k", type=int, default=16, help="pool size K of the imported drafter (default: 16)")
    p.add_argument("src", help="DFlash draft-model directory (config.json, *.safetensors)")
    p.add_argument("out", help="new (or empty) checkpoint directory")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from deploy.dflash_import import import_dflash
    from drelay_model.target import load_target

    path, config = import_dflash(
        args.src, args.out, target=load_target(args.target, dtype=args.dtype, pack=False), top_k=args.top_k
    )
    vocab = f"draft vocabulary {config.draft_vocab_size}" if config.draft_vocab_size else "the target's vocabulary"
    print(f"imported {args.src} → {path} ({config.num_layers} layers, block {config.block_size}, "
          f"features from layers {list(config.target_layer_ids)}, {vocab})")  # fmt: skip
    return 0
