"""The cost-aware policy's settings, replayed offline against recorded one-draft outcomes.

Deciding whether a round drafts is a bandit problem: a round that stays AR learns nothing about the
drafts it skipped. This script measures how well `CostPolicy` (the real class, not a copy)
plays it for a few settings of its shrinkages κ (`rate_prior`) and κ_b (`base_prior`), its margin
(`min_gain`) and its optimism z (`optimism`):

  record    the bundled drafter's first draft at every round of one-draft decoding (greedy replay:
            each round verifies one draft, so rounds advance by 1 or 2 tokens, as in cost-aware
            decoding on this CPU), on held-out prompts of the training corpora (Alpaca 4,500+ and
            GSM8K train 7,000+, past what the bundled drafter was trained on) and, as a check, on
            the eight benchmarks: (accepted?, q of the draft) per round, in order.
  simulate  a fresh policy per prompt (and, in one row, one policy across all the corpus prompts,
            as an engine or endpoint keeps it across requests), with one slot and this machine's
            cached cost curve: each
            round `plan` says draft or AR; a drafted round pays draft(1) (+ the sunk verify(2) if
            `choose` keeps the draft) and commits 1 + hit tokens, an AR round pays verify(1) and
            commits 1; the policy observes only the rounds it drafted.

It prints S = (tokens per ms) ÷ (AR's tokens per ms) per setting, pooled over prompts, beside
"always draft" and the oracle that drafts exactly the rounds that hit. Cost scales stay at 1 (no
timing noise), so the numbers isolate the decision rule.

Run:  .venv/bin/python benchmarks/bench_policy.py            # ~3 min on the CPU default
      .venv/bin/python benchmarks/bench_policy.py --seqs outputs/bench_policy.json   # re-simulate a recording
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from drelay_model.decoding import GenerationConfig  # noqa: E402
from drelay_model.decoding.replay import replay  # noqa: E402
from drelay_model.decoding.cost_policy import CostPolicy, PolicySettings, RoundCosts  # noqa: E402
from drelay_model.selectors.native import NativeSelector  # noqa: E402

MAX_CORPUS_PROMPTS = 13  # Alpaca from index 4,500 in steps of 40: 13 prompts in the 5,000-row subset
# (κ, κ_b, min_gain, z): little shrinkage with a 5% margin, equal κ and κ_b, then the shipped κ/κ_b with z from 0 to 2
SETTINGS = [
    (2.0, 2.0, 0.05, 0.0),
    (16.0, 16.0, 0.0, 0.0),
    (16.0, 2.0, 0.0, 0.0),
    (16.0, 2.0, 0.0, 0.5),
    (16.0, 2.0, 0.0, 1.0),
    (16.0, 2.0, 0.0, 2.0),
]


class OneDraft(NativeSelector):
    """The native path cut to one draft: replay then advances as one-draft decoding does."""

    def select(self, block, ctx):
        s = super().select(block, ctx)
        return type(s)(pool_index=s.pool_index, path_ids=s.path_ids, length=torch.ones_like(s.length), proposal_q=s.proposal_q)


def corpus_prompts(n: int) -> dict[str, list[str]]:
    alpaca = json.loads((REPO / "data/train/alpaca/alpaca_data_5000_subset_pr152.json").read_text())[4500::40][:n]
    from pipelines.data.corpora import source_file
    from pipelines.data.eval_sets import read_rows

    gsm8k = [row.data for row in read_rows(source_file("gsm8k_train"))][7000::30][:n]
    return {"alpaca (train corpus)": [a["instruction"] + ("\n" + a["input"] if a["input"] else "") for a in alpaca],
            "gsm8k (train corpus)": [g["question"] for g in gsm8k]}  # fmt: skip


def record(ar_engine, drafter, messages: list[str], max_new: int) -> list[list[tuple[bool, float]]]:
    """[(hit, q)] per round of one-draft greedy decoding, per prompt (AR's continuations, replayed)."""
    from pipelines.common.chat import user_prompt

    target = ar_engine.target
    prompts = [user_prompt(target.tokenizer, m) for m in messages]
    conts = ar_engine.generate(prompts, GenerationConfig(max_new_tokens=max_new)).tokens
    seqs: list[list[tuple[bool, float]]] = [[] for _ in prompts]

    def hook(r):
        if len(r.ref):
            seqs[r.row].append((bool(r.path[0] == r.ref[0]), float(r.block.cand_logq[0, 0, 0].exp())))

    replay(target, drafter, prompts, conts, selector=OneDraft(), on_round=hook)
    return seqs


def simulate(seqs, costs: RoundCosts, rule: str | tuple[float, ...], *, one_policy: bool = False) -> float:
    """S over the recorded rounds of `rule`: "always" (draft and verify every round), "oracle" (draft
    exactly the rounds that hit) or a policy setting (κ, κ_b, min_gain, z), fresh for each prompt
    unless `one_policy`."""
    t_ar, t_draft, t_wide = costs.verify(1), costs.draft_ms(1, 0), costs.verify(2)  # one row (b = 1)
    tokens = ms = 0.0
    policy = None
    for seq in seqs:
        if isinstance(rule, tuple) and (policy is None or not one_policy):
            kappa, base_kappa, min_gain, z = rule
            policy = CostPolicy(costs, 1, PolicySettings(rate_prior=kappa, base_prior=base_kappa, min_gain=min_gain, optimism=z))
        for hit, q in seq:
            if policy is None:
                drafts = rule == "always" or hit
                kept = int(drafts)
            elif drafts := policy.plan() > 0:
                kept = int(policy.choose(torch.tensor([[q]]), 1)[0])
                policy.observe(torch.tensor([[q]]), torch.tensor([kept]), torch.tensor([int(hit and kept)]))
            if drafts:
                tokens += 1 + (hit and kept)
                ms += t_draft + (t_wide if kept else t_ar)
            else:
                tokens, ms = tokens + 1, ms + t_ar
    # AR commits one token per round in t_ar; compare rates, since the rounds' tokens differ
    return (tokens / ms) / (1.0 / t_ar)


def load_seqs(path: Path, parser: argparse.ArgumentParser):
    """(seqs, corpus names, benchmark names) from an earlier run's JSON; a bad file is a usage error."""
    try:
        data = json.loads(path.read_text())
        seqs = {name: [[(bool(h), float(q)) for h, q in seq] for seq in sets] for name, sets in data["seqs"].items()}
    except (OSError, ValueError, KeyError, TypeError) as e:
        parser.error(f"--seqs {path}: not a bench_policy recording ({type(e).__name__}: {e})")
    corpus = data.get("corpus") or [n for n in seqs if n.endswith("(train corpus)")]  # recordings without a "corpus" key
    return seqs, corpus, data.get("bench") or [n for n in seqs if n not in corpus]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=12, help="held-out corpus prompts per corpus")
    p.add_argument("--bench-prompts", type=int, default=3, help="prompts per benchmark (0: skip)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--out", default=str(REPO / "outputs" / "bench_policy.json"))
    p.add_argument("--seqs", type=Path, help="simulate the outcomes recorded in this earlier --out JSON instead of recording")
    args = p.parse_args(argv)
    if not 1 <= args.prompts <= MAX_CORPUS_PROMPTS or args.bench_prompts < 0 or args.max_new_tokens < 1:
        p.error(f"--prompts must be in 1..{MAX_CORPUS_PROMPTS}, --bench-prompts ≥ 0 and --max-new-tokens ≥ 1")
    recorded = load_seqs(args.seqs, p) if args.seqs else None
    from cli.options import DEFAULT_TARGET
    from pipelines.common.engines import build_engine
    from pipelines.common.methods import AR, MethodSpec, load_target_spec, resolve_method
    from pipelines.data.eval_sets import BENCHMARKS, load_benchmark

    target = load_target_spec(DEFAULT_TARGET)
    engine = build_engine(target, resolve_method("native", target_spec=DEFAULT_TARGET), "cost", target_spec=DEFAULT_TARGET)
    ar_engine = build_engine(target, MethodSpec(AR), target_spec=DEFAULT_TARGET)
    costs = engine.costs
    if recorded is None:
        sets = corpus_prompts(args.prompts)
        corpus = list(sets)
        bench = list(BENCHMARKS) if args.bench_prompts else []
        sets |= {b: [x.turns[0] for x in load_benchmark(b, limit=args.bench_prompts, seed=7)] for b in bench}
        seqs = {name: record(ar_engine, engine.drafter, msgs, args.max_new_tokens) for name, msgs in sets.items()}
    else:
        seqs, corpus, bench = recorded
    print(
        f"costs: verify(1) {costs.verify(1):.1f} ms, verify(2) {costs.verify(2):.1f} ms, draft(1) + extension {costs.draft_ms(1, 0):.1f} ms"
    )
    rules = ["always", "oracle", *SETTINGS]
    header = ["always draft", "oracle"] + [f"κ {k:g}, κ_b {b:g}, margin {m:g}, z {z:g}" for k, b, m, z in SETTINGS]
    table = {name: [simulate(s, costs, rule) for rule in rules] for name, s in seqs.items()}
    groups = {name: [name] for name in seqs}  # the rows' prompt sets, for their hit rates
    pooled = [x for n in corpus for x in seqs[n]]
    groups["train corpora (pooled)"] = groups["train corpora, one policy for all"] = corpus
    table["train corpora (pooled)"] = [simulate(pooled, costs, rule) for rule in rules]
    table["train corpora, one policy for all"] = [simulate(pooled, costs, rule, one_policy=True) for rule in rules]
    if bench:
        groups["mean of the benchmarks"] = bench
        table["mean of the benchmarks"] = [statistics.mean(table[n][i] for n in bench) for i in range(len(rules))]
    print("| prompts | first-draft hit rate | " + " | ".join(header) + " |")
    print("|---|---|" + "---|" * len(header))
    for name, row in table.items():
        hits = [h for n in groups[name] for s in seqs[n] for h, _ in s]
        print(f"| {name} | {statistics.mean(hits):.3f} | " + " | ".join(f"{x:.3f}" for x in row) + " |")
    if recorded is None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps({"header": header, "table": table, "corpus": corpus, "bench": bench, "seqs": seqs}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
