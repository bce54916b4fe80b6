"""`drelay generate`: prompts (or a chat message) in, text out, with τ and tokens/s."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from drelay_model.errors import DRelayError
from cli.options import (
    add_bootstrap_options,
    add_max_new_tokens,
    add_target,
    add_threads,
    add_verify_length,
    bootstrap_options,
    decode_config,
    thread_policy,
)
from pipelines.common.chat import user_prompt
from pipelines.common.engines import build_engine
from pipelines.common.intervals import MIN_PAIRS, Interval, paired_rate_ratio
from pipelines.common.methods import AR, NATIVE, MethodSpec, load_target_spec, method_names, resolve_method


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text with speculative decoding", description=__doc__)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--chat", action="append", metavar="MESSAGE", help="a user message; the chat template is applied (repeatable)"
    )
    src.add_argument("--prompt", action="append", metavar="TEXT", help="raw prompt text, no template (repeatable)")
    src.add_argument("--prompts-file", metavar="FILE", help="one chat message per line")
    add_target(p)
    p.add_argument("--method", default=NATIVE, help=f"decoding method: {', '.join(method_names())}")
    p.add_argument("--checkpoint", help="drafter checkpoint directory (default: the one bundled for the target)")
    p.add_argument("--random-drafter", action="store_true", help="use an untrained drafter (smoke tests and timing only)")
    p.add_argument("--temperature", type=float, default=0.0)
    add_max_new_tokens(p)
    p.add_argument("--seed", type=int, default=0)
    add_verify_length(p)
    add_threads(p)
    p.add_argument("--compare-ar", action="store_true",
                   help="also decode autoregressively on the same engine and print the speedup: after a short "
                        "warm-up of both, --repeats pairs alternate (AR first, then the method first, ...); the "
                        "speedup is the method's tokens/s over all pairs (total tokens ÷ total seconds) ÷ AR's, "
                        f"with its 95%% interval from a bootstrap over the pairs (needs --repeats ≥ {MIN_PAIRS})")  # fmt: skip
    p.add_argument("--repeats", type=int, default=3, help="paired repetitions for --compare-ar (default 3)")
    add_bootstrap_options(p)
    p.add_argument("--warmup", action="store_true",
                   help="decode 8 tokens first, untimed, so the figures leave out first-call set-up "
                        "(allocations, kernel selection), as a server's warm engine does")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--verbose", action="store_true",
                   help="also print the engine's settings to stderr: the CPU kernels it runs with "
                        "(set by DRELAY_PACKED_LINEARS, DRELAY_BF16_POOL, DRELAY_INT8_DRAFT) and its threads")  # fmt: skip
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
    if args.repeats < 1:
        raise DRelayError(f"--repeats must be ≥ 1, got {args.repeats}")
    config = decode_config(args.max_new_tokens, args.temperature, args.seed)
    bootstrap = bootstrap_options(args)
    threads = thread_policy(args.threads)
    target = load_target_spec(args.target, device=args.device, dtype=args.dtype)
    spec = resolve_method(args.method, target_spec=args.target, checkpoint=args.checkpoint, random_drafter=args.random_drafter)
    messages, prompt_ids = _read_prompts(args, target.tokenizer)
    # the batch never holds more rows than prompts: the cost surface need not reach further
    engine = build_engine(target, spec, args.verify_length, target_spec=args.target, max_batch=len(prompt_ids), threads=threads)
    if args.verbose:
        print(engine.describe_kernels(), file=sys.stderr)
        print(threads.describe(), file=sys.stderr)
    timing = None
    if args.compare_ar and not spec.is_ar:
        ar_engine = build_engine(target, MethodSpec(AR), target_spec=args.target, threads=threads)
        timing = paired_with_ar(engine, ar_engine, prompt_ids, config, args.repeats, bootstrap)
        result = timing.result
    else:
        if args.warmup:
            engine.generate(prompt_ids, dataclasses.replace(config, max_new_tokens=min(8, config.max_new_tokens)))
        result = engine.generate(prompt_ids, config)
    report = {"method": args.method, "target": args.target, "verify_length": args.verify_length, **result.stats.summary()}
    if timing is not None:
        report.update(timing.report())
        report["same_output_as_ar"] = timing.ar.tokens == result.tokens if config.greedy else None
    texts = [target.tokenizer.decode(t, skip_special_tokens=True) for t in result.tokens]
    if args.json:
        print(json.dumps({"outputs": texts, **report}, indent=2))
        return 0
    for msg, text in zip(messages, texts):
        print(f"### {msg}\n{text}\n")
    line = f"[{args.method}, {args.verify_length} length] τ={report['tau']:.2f}  {report['tokens_per_s']:.1f} tok/s  ({report['generated_tokens']} tokens, {report['wall_s']:.1f} s)"
    if timing is not None:
        line += f"  | AR {report['ar_tokens_per_s']:.1f} tok/s  speedup {timing.describe()}"
        if report["same_output_as_ar"] is not None:
            line += f"  | output identical to AR: {'yes' if report['same_output_as_ar'] else 'NO'}"
    print(line, file=sys.stderr if args.json else sys.stdout)
    return 0


@dataclass(frozen=True)
class PairedTiming:
    """The method timed against AR over paired repetitions.

    speedup = (Σ method tokens ÷ Σ method seconds) ÷ (Σ AR tokens ÷ Σ AR seconds) over the pairs,
    prefill included; its interval resamples the pairs (each keeps its two runs together), and is
    None with fewer than MIN_PAIRS pairs. `result` and `ar` are the runs of the median pair (the
    one whose own ratio is the median): their text, τ and phase times are reported."""

    result: object  # GenerationResult of the method, median pair
    ar: object  # GenerationResult of AR, median pair
    speedup: Interval
    pair_speedups: list[float]  # method tok/s ÷ AR tok/s of each pair, in run order
    method_tokens_per_s: float  # pooled over the pairs
    ar_tokens_per_s: float
    method_wall_s: float  # mean seconds per method run

    @property
    def resolved(self) -> bool:
        return len(self.pair_speedups) >= MIN_PAIRS

    def report(self) -> dict:
        """The JSON report's timing fields (the interval's bounds None below MIN_PAIRS pairs)."""
        low, high = (self.speedup.low, self.speedup.high) if self.resolved else (None, None)
        return {
            "tokens_per_s": self.method_tokens_per_s,
            "wall_s": self.method_wall_s,
            "ar_tokens_per_s": self.ar_tokens_per_s,
            "speedup": self.speedup.point,
            "speedup_ci_low": low,
            "speedup_ci_high": high,
            "repeats": len(self.pair_speedups),
            "speedups": self.pair_speedups,
        }

    def describe(self) -> str:
        """`1.21× [1.15, 1.27] (5 paired repeats)`."""
        n = len(self.pair_speedups)
        repeats = f"{n} paired repeat{'s' if n > 1 else ''}"
        if not self.resolved:
            return f"{self.speedup.point:.2f}× ({repeats}; an interval needs ≥ {MIN_PAIRS} repeats)"
        return f"{self.speedup.point:.2f}× [{self.speedup.low:.2f}, {self.speedup.high:.2f}] ({repeats})"


def paired_with_ar(engine, ar_engine, prompt_ids, config, repeats: int, bootstrap: dict) -> PairedTiming:
    """Time the method against AR on the same prompts, so that neither pays the other's warm-up
    (first-call allocations, weight packing) and machine load hits both alike: one short decode of
    each, then `repeats` pairs in alternating order (AR first, then the method first, ...).
    `bootstrap`: the interval's `resamples` and `seed`."""
    warm = dataclasses.replace(config, max_new_tokens=min(8, config.max_new_tokens))
    engine.generate(prompt_ids, warm)
    ar_engine.generate(prompt_ids, warm)
    pairs = []
    for i in range(repeats):
        if i % 2 == 0:
            ar, result = ar_engine.generate(prompt_ids, config), engine.generate(prompt_ids, config)
        else:
            result, ar = engine.generate(prompt_ids, config), ar_engine.generate(prompt_ids, config)
        pairs.append((result.stats.tokens_per_second / max(ar.stats.tokens_per_second, 1e-9), result, ar))
    method_stats, ar_stats = [p[1].stats for p in pairs], [p[2].stats for p in pairs]
    speedup = paired_rate_ratio(
        [s.generated for s in method_stats],
        [s.time_total for s in method_stats],
        [s.generated for s in ar_stats],
        [s.time_total for s in ar_stats],
        **bootstrap,
    )
    _, result, ar = sorted(pairs, key=lambda p: p[0])[(repeats - 1) // 2]
    return PairedTiming(
        result=result,
        ar=ar,
        speedup=speedup,
        pair_speedups=[p[0] for p in pairs],
        method_tokens_per_s=sum(s.generated for s in method_stats) / sum(s.time_total for s in method_stats),
        ar_tokens_per_s=sum(s.generated for s in ar_stats) / sum(s.time_total for s in ar_stats),
        method_wall_s=sum(s.time_total for s in method_stats) / repeats,
    )
