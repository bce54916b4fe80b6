"""`drelay export --format sglang [--target T] [--context-length N] <checkpoint> <out>`: a drafter checkpoint →
an HF-style draft-model directory that SGLang loads through the plugin's `DRelayDraftModel` (model.py).

Output: `config.json` (HF fields + `architectures = ["DRelayDraftModel"]`, `max_position_embeddings`
= the target's context length, by default read from the target's config, our drafter config under
`drelay_drafter`, the trained selector's name/config under `drelay_selector`) and
`model.safetensors` (the drafter's trainable weights, the draft-vocab map and the selector's weights,
under model.py's exported names; never the target's frozen embedding or LM head). Written into a
temp directory and renamed into place: a failed export leaves nothing behind.

Bad input (missing or corrupted checkpoint, existing non-empty output, unknown format) is one line
on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from deploy.draft_config import architecture_fields
from deploy.sglang.model import ARCHITECTURE, CONFIG, MODEL_TYPE, WEIGHTS, exported_name
from drelay_model.atomic import atomic_directory
from drelay_model.drafter import DrafterConfig, read_checkpoint
from drelay_model.drafter.config import TargetFingerprint
from drelay_model.errors import DRelayError

FORMATS = ("sglang",)
CONTEXT_HELP = "the target's context length: its config's max_position_embeddings (40960 for Qwen3-4B and Qwen3-8B)"
MASK_TOKEN = "<|drelay_mask|>"


def hf_config(config: DrafterConfig, meta: dict, *, dtype: torch.dtype, has_selector: bool, context_length: int) -> dict:
    """config.json of the export: the usual HF fields (what SGLang's loader reads) plus ours."""
    doc = {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        **architecture_fields(config, dtype=dtype),
        # SGLang's draft worker builds the draft's ModelConfig with the *target's* context length and
        # refuses one above the draft config's own (`max_position_embeddings`; Qwen3Config's default
        # is 32,768, Qwen3-4B/8B serve 40,960). The drafter's RoPE has no table, so the target's
        # context length is the draft's.
        "max_position_embeddings": context_length,
        "vocab_size": config.target.vocab_size if config.target is not None else None,
        # mask_token(_id): the DFLASH worker fills slots 1..H with this id before embedding them;
        # our model class overwrites those slots with `mask_embedding`, so any in-vocabulary id
        # works. A name no tokenizer has, so SGLang's tokenizer cross-check never conflicts.
        "dflash_config": {
            "target_layer_ids": list(config.target_layer_ids),
            "block_size": config.block_size,
            "mask_token": MASK_TOKEN,
            "mask_token_id": 0,
        },
        "drelay_drafter": config.to_dict(),
    }
    if doc["vocab_size"] is None:
        del doc["vocab_size"]
    if has_selector:
        doc["drelay_selector"] = meta["selector"]
    return doc


EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def export_sglang(
    checkpoint: str | Path, out: str | Path, *, context_length: int | None = None, target_config=None, dtype: str = "bfloat16"
) -> Path:
    """Export `checkpoint` to the new directory `out` (must not exist or be empty), its floating
    weights cast to `dtype` (bfloat16 by default: the serving dtype of the Qwen3 targets; give the
    target's dtype otherwise). `torch_dtype` in config.json says the same, so SGLang's `--dtype auto`
    loads the draft in it (a float32 draft config would become float16 beside a bf16 target).
    `context_length` is the target's (its config's `max_position_embeddings`: 40,960 for
    Qwen3-4B/8B); the export carries it so SGLang accepts the draft beside that target.
    `target_config` (the target's Hugging Face config, `load_target_config`): the checkpoint must
    have been trained for that target; `context_length` then defaults to the target's and may not
    exceed it. One of the two is needed."""
    if dtype not in EXPORT_DTYPES:
        raise DRelayError(f"--dtype: unknown dtype '{dtype}' (choose from: {', '.join(EXPORT_DTYPES)})")
    if context_length is None and target_config is None:
        raise DRelayError("--context-length: needed without a target config (the target's max_position_embeddings)")
    if context_length is not None and (
        isinstance(context_length, bool) or not isinstance(context_length, int) or context_length < 1
    ):
        raise DRelayError(f"--context-length: expected the target's context length, a positive integer (got {context_length!r})")
    from safetensors.torch import save_file

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DRelayError(f"output '{out}' already exists and is not an empty directory")
    config, tensors, meta = read_checkpoint(checkpoint)
    if target_config is not None:
        context_length = _target_context_length(config, target_config, context_length)
    ids = list(config.target_layer_ids)
    if ids != sorted(set(ids)):  # SGLang concatenates the captured layers in layer order
        raise DRelayError(
            f"checkpoint '{checkpoint}': target_layer_ids {ids} are not strictly ascending (SGLang captures features in layer order)"
        )
    n_layers = config.target.num_layers if config.target is not None else None
    if n_layers is not None and max(ids) >= n_layers - 1:
        raise DRelayError(
            f"checkpoint '{checkpoint}': target_layer_ids {ids} include the target's last layer {n_layers - 1} "
            "(SGLang captures layer k's output before layer k+1 runs, so the last layer cannot be a feature layer)"
        )
    has_selector = any(k.startswith("selector.") for k in tensors)
    if has_selector and not (meta.get("selector") or {}).get("name"):
        raise DRelayError(f"checkpoint '{checkpoint}' holds selector tensors but no meta.selector name")
    cast = EXPORT_DTYPES[dtype]
    renamed = {exported_name(k): (v.to(cast) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
    if len(renamed) != len(tensors):
        raise DRelayError(f"checkpoint '{checkpoint}': two tensors map to the same exported name")
    with atomic_directory(out) as tmp:
        save_file(renamed, str(tmp / WEIGHTS), metadata={"format": "pt"})
        doc = hf_config(config, meta, dtype=cast, has_selector=has_selector, context_length=context_length)
        (tmp / CONFIG).write_text(json.dumps(doc, indent=2))
    return out


def _target_context_length(config: DrafterConfig, target_config, given: int | None) -> int:
    """The context length an export for this target carries: the target's `max_position_embeddings`,
    or `given` where it is no larger; the drafter must have been trained for the target."""
    fingerprint = TargetFingerprint(
        target_config.model_type, target_config.hidden_size, target_config.vocab_size, target_config.num_hidden_layers
    )
    if config.target is not None and config.target != fingerprint:
        raise DRelayError(f"--target: the drafter was trained for another target ({config.target}) than this one ({fingerprint})")
    have = int(target_config.max_position_embeddings)
    if given is not None and given > have:
        raise DRelayError(f"--context-length: {given} exceeds the target's context length {have} (its max_position_embeddings)")
    return have if given is None else given


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints usage + error)
        print(f"drelay export: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    """CLI entry: `drelay export --format sglang --context-length N CHECKPOINT OUT`. Returns 0, or exits 2."""
    parser = _Parser(prog="drelay export", description="Export a drafter checkpoint for a serving framework.")
    parser.add_argument("--format", required=True, help=f"output format ({', '.join(FORMATS)})")
    parser.add_argument("checkpoint", help="drafter checkpoint directory (drafter.safetensors + drafter_config.json)")
    parser.add_argument("out", help="new output directory")
    parser.add_argument("--dtype", default="bfloat16", help=f"weight dtype ({', '.join(EXPORT_DTYPES)}; default bfloat16)")
    parser.add_argument("--context-length", type=int, required=True, help=CONTEXT_HELP)
    args = parser.parse_args(argv)
    if args.format not in FORMATS:
        parser.error(f"--format: unknown format '{args.format}' (choose from: {', '.join(FORMATS)})")
    try:
        path = export_sglang(args.checkpoint, args.out, dtype=args.dtype, context_length=args.context_length)
    except DRelayError as exc:
        parser.error(str(exc))
    print(f"exported {args.checkpoint} → {path} ({ARCHITECTURE})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
