"""How closely the target agrees with itself between AR and verification: the logits of the same
position computed one token per forward (AR's step) and inside a verification block of 1 + L tokens.

Greedy speculative decoding is lossless when every verification argmax equals AR's token. Our CPU
kernels are not shape-invariant to the last bit (SDPA's CPU kernel rounds a query by how many
queries share the call; oneDNN rounds a single row through a weight of more than 1,024 inputs on its
own), so the two differ by rounding. This measures by how much, and whether it ever changes a token.

For each prompt (held-out benchmark prompts, first turn): AR decodes `--max-new-tokens` greedily and
keeps each step's logits [V]; then, for each L in --verify-lengths, a fresh cache prefills the prompt
and the same continuation is re-read in blocks of 1 + L tokens (logits [1 + L, V] per block), as
verification reads an all-accepted draft. Per L it prints the positions compared, the largest
|Δ logit|, the greedy disagreements, and how many positions have AR's top-2 margin below that largest
|Δ| (where rounding of that size could change the token).

    .venv/bin/python analysis/ar_verify_agreement.py [--benchmarks gsm8k,mt_bench] [--prompts 4] [--max-new-tokens 96]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from drelay_model.errors import DRelayError  # noqa: E402


@torch.no_grad()
def ar_logits(target, prompt: list[int], max_new: int) -> tuple[list[int], torch.Tensor]:
    """Greedy AR from `prompt` → (the new tokens [T], the logits that chose each [T, V])."""
    cache = target.new_cache(1, len(prompt) + max_new + 1)
    out = target.forward(torch.tensor([prompt]), cache, logits_at=torch.tensor([[len(prompt) - 1]]))
    tokens, logits = [], []
    step = out.logits[0, -1]
    for _ in range(max_new):
        tokens.append(int(step.argmax()))
        logits.append(step)
        if tokens[-1] in target.eos_token_ids:
            break
        step = target.forward(torch.tensor([[tokens[-1]]]), cache).logits[0, -1]
    return tokens, torch.stack(logits)


@torch.no_grad()
def block_logits(target, prompt: list[int], tokens: list[int], block: int) -> torch.Tensor:
    """The logits that choose tokens[0..T-1], read in blocks of `block` tokens after the prompt's
    last token (a verification of `block - 1` drafted tokens, all accepted) → [T, V]."""
    cache = target.new_cache(1, len(prompt) + len(tokens) + block + 1)
    target.forward(torch.tensor([prompt[:-1]]), cache, logits_at=torch.tensor([[len(prompt) - 2]]))
    fed = [prompt[-1]] + tokens[:-1]  # position i's input; its logits choose tokens[i]
    out = [target.forward(torch.tensor([fed[i : i + block]]), cache).logits[0] for i in range(0, len(fed), block)]
    return torch.cat(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--benchmarks", default="gsm8k,math500,humaneval,mbpp,mt_bench,alpaca")
    p.add_argument("--prompts", type=int, default=4, help="prompts per benchmark")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--verify-lengths", default="1,3,7,15", help="L: blocks of 1 + L tokens")
    args = p.parse_args(argv)
    from pipelines.data.eval_sets import BENCHMARKS, first_turn_prompts

    try:
        lengths = [int(x) for x in args.verify_lengths.split(",")]
    except ValueError:
        lengths = [0]
    if any(L < 1 for L in lengths):
        p.error(f"--verify-lengths: positive integers, got {args.verify_lengths!r}")
    if args.prompts < 1 or args.max_new_tokens < 2:
        p.error("--prompts must be ≥ 1 and --max-new-tokens ≥ 2")
    names = args.benchmarks.split(",")
    unknown = [b for b in names if b not in BENCHMARKS]
    if unknown:
        p.error(f"--benchmarks: unknown {', '.join(unknown)}; valid: {', '.join(BENCHMARKS)}")
    from drelay_model.target import load_target

    try:
        target = load_target("smollm2-135m")
        prompts = [ids for b in names for ids in first_turn_prompts(target.tokenizer, b, args.prompts)]
    except DRelayError as exc:
        p.error(str(exc))
    runs = [(prompt, *ar_logits(target, prompt, args.max_new_tokens)) for prompt in prompts]
    top2 = torch.cat([ar.topk(2, dim=-1).values for _, _, ar in runs])  # [positions, 2]
    margins = top2[:, 0] - top2[:, 1]  # AR's own: how close each greedy choice was
    print("| verify block (1 + L) | positions | max abs Δ logit | greedy disagreements | positions with top-2 margin < max Δ |")
    print("|---|---|---|---|---|")
    for L in lengths:
        n = flips = 0
        worst = 0.0
        for prompt, tokens, ar in runs:
            ver = block_logits(target, prompt, tokens, 1 + L)
            worst = max(worst, float((ver - ar).abs().max()))
            flips += int((ver.argmax(-1) != torch.tensor(tokens)).sum())
            n += len(tokens)
        close = int((margins < worst).sum())
        print(f"| 1 + {L} | {n} | {worst:.2e} | {flips} | {close} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
