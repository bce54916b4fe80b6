"""`drelay generate`: prompts (or a chat message) in, text out, with τ and tokens/s."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from drelay_model.decoding import SpeculativeEngine
from drelay_model.errors import DRelayError
from pipelines.cli.options import add_max_new_tokens, add_target, decode_config
from pipelines.common.chat import user_prompt
from pipelines.common.costs import VERIFY_LENGTHS, verify_costs
from pipelines.common.methods import NATIVE, load_method, load_target_spec, method_names, resolve_method


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text with speculative decoding", description=__doc__)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--chat", action="append", metavar="MESSAGE", help="a user message; the chat template is applied (repeatable)")
    src.add_argument("--prompt", action="append", metavar="TEXT", help="raw prompt text, no template (repeatable)")
    src.add_argument("--prompts-file", metavar="FILE", help="one chat message per line")
    add_target(p)
    p.add_argument("--method", default=NATIVE, help=f"decoding method: {', '.join(method_names())}")
    p.add_argument("--checkpoint", help="drafter checkpoint directory (default: the one bundled for the target)")
    p.add_argument("--random-drafter", action="store_true", help="use an untrained drafter (smoke tests and timing only)")
    p.add_argument("--temperature", type=float, default=0.0)
    add_max_new_tokens(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verify-length", choices=VERIFY_LENGTHS, default="cost",
                   help="cost: each round verifies as many drafts as pays off on this machine (0 = an AR step; "
                        "costs measured once and cached, see `drelay costs`); fixed: the whole path (the paper's setting)")  # fmt: skip
    p.add_argument("--compare-ar", action="store_true", help="also decode autoregressively and print the speedup")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(run=run)


def _read_prompts(args, tokenizer) -> tuple[list[str], list[list[int]]]:
    if args.prompts_file:
        path = Path(args.prompts_file)
        if not path.is_file():
            raise DRelayError(f"--prompts-file '{path}' not found")
        messages = [line.strip() for line in path.read_text().splitlines() if line.strip()]
        if not messages:
            raise DRelayError(f"--prompts-file '{path}' holds no prompts")
        chat = True
    else:
        messages, chat = (args.chat, True) if args.chat else (args.prompt, False)
    if any(not m.strip() for m in messages):
        raise DRelayError("empty prompt")
    if tokenizer is None:
        raise DRelayError("this target has no tokenizer; use a Hugging Face target for text prompts")
    return messages, [user_prompt(tokenizer, m) if chat else tokenizer(m)["input_ids"] for m in messages]


def run(args: argparse.Namespace) -> int:
    config = decode_config(args.max_new_tokens, args.temperature, args.seed)
    target = load_target_spec(args.target, device=args.device, dtype=args.dtype)
    spec = resolve_method(args.method, target_spec=args.target, checkpoint=args.checkpoint, random_drafter=args.random_drafter)
    messages, prompt_ids = _read_prompts(args, target.tokenizer)
    drafter, selector = load_method(spec, target)
    costs = None
    if args.verify_length == "cost" and not spec.is_ar:
        costs = verify_costs(target, drafter, selector, target_spec=args.target, spec=spec)
    result = SpeculativeEngine(target, drafter, selector, costs=costs).generate(prompt_ids, config)
    report = {"method": args.method, "target": args.target, "verify_length": args.verify_length, **result.stats.summary()}
    if args.compare_ar and not spec.is_ar:
        ar = SpeculativeEngine(target).generate(prompt_ids, config)
        report["ar_tokens_per_s"] = ar.stats.tokens_per_second
        report["speedup"] = result.stats.tokens_per_second / max(ar.stats.tokens_per_second, 1e-9)
        report["same_output_as_ar"] = ar.tokens == result.tokens if config.greedy else None
    texts = [target.tokenizer.decode(t, skip_special_tokens=True) for t in result.tokens]
    if args.json:
        print(json.dumps({"outputs": texts, **report}, indent=2))
        return 0
    for msg, text in zip(messages, texts):
        print(f"### {msg}\n{text}\n")
    line = f"[{args.method}, {args.verify_length} length] τ={report['tau']:.2f}  {report['tokens_per_s']:.1f} tok/s  ({report['generated_tokens']} tokens, {report['wall_s']:.1f} s)"
    if "speedup" in report:
        line += f"  | AR {report['ar_tokens_per_s']:.1f} tok/s  speedup {report['speedup']:.2f}×"
        if report["same_output_as_ar"] is not None:
            line += f"  | output identical to AR: {'yes' if report['same_output_as_ar'] else 'NO'}"
    print(line, file=sys.stderr if args.json else sys.stdout)
    return 0
