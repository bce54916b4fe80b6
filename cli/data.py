"""`drelay data …`: data preparation jobs (pipelines/data/)."""

from __future__ import annotations

import argparse
from pathlib import Path

from drelay_model.errors import DRelayError
from cli.options import check_limit, decode_config
from pipelines.data.corpora import DEFAULT_TRAIN_SOURCES, load_sharegpt, load_training_corpus
from pipelines.data.regenerate import output_plan, regenerate

MAX_PROMPT_TOKENS = 1024  # a conversation whose prompt outgrows this is recorded as too long
DEFAULT_REGENERATE_TOKENS = 256  # the CPU default corpus (SmolLM2 answers) was made with this
from pipelines.common.methods import load_target_spec
from pipelines.common.paths import repo_path


def add_parser(sub) -> None:
    data = sub.add_parser("data", help="data preparation")
    jobs = data.add_subparsers(dest="job", required=True, metavar="JOB")
    p = jobs.add_parser("regenerate", help="replace assistant turns by the target's own greedy generations (resumable)")
    p.add_argument("--config", metavar="TRAIN_YAML",
                   help="take the target, its dtype, the output file (data.regenerated) and the answer budget "
                        "(data.max_seq_len minus the prompt budget) from a training config")  # fmt: skip
    p.add_argument("--target", help="target spec (default: smollm2-135m, or the --config's target.spec)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: CUDA when present (bf16 there)")
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        help="default: the --config's target.dtype, else bfloat16 on CUDA, float32 on CPU",
    )
    p.add_argument("--sources", default=",".join(DEFAULT_TRAIN_SOURCES), help="comma-separated corpus names")
    p.add_argument("--sharegpt", metavar="FILE", help="a ShareGPT-style JSON/JSONL file instead of the built-in corpus")
    p.add_argument("--out", help="output JSONL (default: data/regenerated/<target>.jsonl)")
    p.add_argument("--engine", choices=("ours", "vllm"), default="ours",
                   help="vllm: vLLM through Ray Data LLM in the vLLM venv (make vllm-env), one job per batch")  # fmt: skip
    p.add_argument("--batch-size", type=int, help="conversations per batch (default: 16; 512 with --engine vllm)")
    p.add_argument("--vllm-log", help="with --engine vllm: append the Ray Data job's output here")
    p.add_argument("--max-new-tokens", type=int, help="per answer (default: 256, or data.max_seq_len − 1024 with --config)")
    p.add_argument("--limit", type=int, help="only the first N conversations (smoke runs)")
    p.add_argument(
        "--shard", metavar="K/N", help="process every N-th conversation from the K-th (parallel processes, one file each)"
    )
    p.set_defaults(run=run_regenerate)


def _settings(args: argparse.Namespace) -> tuple[str, str, str, str | None, int]:
    """(target spec, device, dtype, output file or None, max new tokens) from the flags and --config."""
    import torch

    from drelay_model.device import resolve_device

    spec, dtype, out, budget = args.target or "smollm2-135m", args.dtype, args.out, args.max_new_tokens
    if args.config:
        from pipelines.train.config import load_config

        cfg = load_config(args.config)
        spec = args.target or cfg.target.spec
        dtype = dtype or cfg.target.dtype
        if out is None and not any(ch in cfg.data.regenerated for ch in "*?["):
            out = str(repo_path(cfg.data.regenerated))
        budget = budget or max(cfg.data.max_seq_len - MAX_PROMPT_TOKENS, 1)
    device = str(resolve_device(args.device))  # `cuda` without CUDA: a one-line error
    dtype = dtype or ("bfloat16" if torch.device(device).type == "cuda" else "float32")
    return spec, device, dtype, out, budget or DEFAULT_REGENERATE_TOKENS


def run_regenerate(args: argparse.Namespace) -> int:
    check_limit(args.limit)
    spec, device, dtype, out_file, budget = _settings(args)
    decode = decode_config(budget)
    shard = _parse_shard(args.shard) if args.shard else None
    if args.sharegpt:
        conversations = load_sharegpt(args.sharegpt)
    else:
        conversations = load_training_corpus([s.strip() for s in args.sources.split(",") if s.strip()])
    if args.limit:
        conversations = conversations[: args.limit]
    if shard is not None:
        conversations = conversations[shard[0] :: shard[1]]
    if args.engine == "vllm":
        from deploy.vllm.regenerate import require_vllm_python

        require_vllm_python()  # before loading anything
    out, done_elsewhere = output_plan(spec, out_file, shard)
    target = load_target_spec(spec, device=device, dtype=dtype)
    generate, batch_size = None, args.batch_size or 16
    if args.engine == "vllm":
        from deploy.vllm.regenerate import JOB_SIZE, RayDataVllmGenerator, vllm_settings

        log = Path(args.vllm_log) if args.vllm_log else None
        generate, batch_size = (
            RayDataVllmGenerator(vllm_settings(target, spec, budget, dtype, device, log)),
            args.batch_size or JOB_SIZE,
        )
    via = " through Ray Data LLM + vLLM" if args.engine == "vllm" else ""
    print(f"regenerating with {spec} on {device} ({dtype}){via}, ≤ {budget} new tokens per answer → {out}")
    summary = regenerate(target, conversations, out, batch_size=batch_size, decode=decode, done_elsewhere=done_elsewhere,
                         max_prompt_tokens=MAX_PROMPT_TOKENS, generate=generate)  # fmt: skip
    print(
        f"regenerated {summary.generated} conversations ({summary.done_before} already done, "
        f"{summary.skipped_too_long} skipped as too long), {summary.tokens} tokens in {summary.seconds:.0f} s → {summary.path}"
    )
    return 0


def _parse_shard(text: str) -> tuple[int, int]:
    k, _, n = text.partition("/")
    if not (k.isdigit() and n.isdigit()) or not 0 <= int(k) < int(n):
        raise DRelayError(f"--shard must be K/N with 0 ≤ K < N, got '{text}'")
    return int(k), int(n)
