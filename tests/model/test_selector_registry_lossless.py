"""Every trainable selector in the registry, with random (non-native) weights: lossless greedy decoding,
replay = real decoding (also for paths `dspark` shortens), checkpoint round trip, and a few real joint
training steps that reach the selector's parameters."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")

from drelay_model.decoding import GenerationConfig, SpeculativeEngine, replay
from drelay_model.drafter import load_drafter, save_drafter
from drelay_model.selectors import default_registry, trainable_selectors
from drelay_model.training.step import DraftTrainModule, StepConfig, training_step

MAX_NEW = 32
# dspark with a high cumulative-confidence threshold, so that it does shorten paths.
OVERRIDES = {"dspark": {"threshold": 0.3}}


def _random_selector(name, drafter, tiny_selector_config, seed=0):
    torch.manual_seed(seed)
    sel = default_registry().create(name, drafter=drafter, config={**tiny_selector_config(name), **OVERRIDES.get(name, {})})
    for p in sel.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return sel.eval()


@pytest.mark.parametrize("name", trainable_selectors())
def test_random_selector_is_lossless_and_replay_matches_real_decoding(
    hf_greedy, target, make_drafter, prompts_of, tiny_selector_config, name
):
    drafter = make_drafter(target, top_k=16)
    sel = _random_selector(name, drafter, tiny_selector_config)
    prompts = prompts_of(target.vocab_size, (5, 9, 3, 12))
    real = SpeculativeEngine(target, drafter, sel).generate(prompts, GenerationConfig(max_new_tokens=MAX_NEW))
    for b, p in enumerate(prompts):
        assert real.tokens[b] == hf_greedy(target, p, MAX_NEW), f"{name}: row {b} differs from HF generate"
    replayed = replay(target, drafter, prompts, real.tokens, selector=sel)
    assert (replayed.rounds, replayed.committed) == (real.stats.rounds, real.stats.committed)
    assert replayed.accept_hist.tolist() == real.stats.accept_hist.tolist()


def test_dspark_shortens_paths_and_stays_lossless(hf_greedy, target, make_drafter, prompts_of, tiny_selector_config):
    drafter = make_drafter(target, top_k=16)
    sel = _random_selector("dspark", drafter, tiny_selector_config)
    lengths = []
    real_select = sel.select
    sel.select = lambda block, ctx: (lambda s: (lengths.extend(s.length.tolist()), s)[1])(real_select(block, ctx))
    prompts = prompts_of(target.vocab_size, (5, 9))
    out = SpeculativeEngine(target, drafter, sel).generate(prompts, GenerationConfig(max_new_tokens=MAX_NEW))
    assert min(lengths) < drafter.config.num_slots, "the threshold should cut some paths"
    assert sel.capabilities.may_shorten
    for b, p in enumerate(prompts):
        assert out.tokens[b] == hf_greedy(target, p, MAX_NEW)


@pytest.mark.parametrize("name", trainable_selectors())
def test_checkpoint_round_trip(tmp_path, target, make_drafter, prompts_of, tiny_selector_config, name):
    drafter = make_drafter(target, top_k=8)
    sel = _random_selector(name, drafter, tiny_selector_config)
    extra = {f"selector.{k}": v for k, v in sel.state_dict().items()}
    save_drafter(drafter, tmp_path / "ck", extra_tensors=extra, meta={"selector": {"name": name, "config": sel.config.to_dict()}})
    d2, tensors, meta = load_drafter(tmp_path / "ck", target)
    back = default_registry().from_checkpoint(name, drafter=d2, tensors=tensors, meta=meta)
    assert back.config == sel.config
    prompts = prompts_of(target.vocab_size, (6,))
    cfg = GenerationConfig(max_new_tokens=12)
    a = SpeculativeEngine(target, drafter, sel).generate(prompts, cfg).stats
    b = SpeculativeEngine(target, d2, back).generate(prompts, cfg).stats
    assert a.accept_hist.tolist() == b.accept_hist.tolist()


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "drelay" else n for n in trainable_selectors()])
def test_joint_steps_train_every_selector_parameter(target, make_drafter, tiny_selector_config, name):
    """A few real joint steps on the tiny target: finite losses, and every selector parameter moves
    (zero-initialised output layers first, then everything behind them)."""
    if not target.name.startswith("tiny-llama"):
        pytest.skip("one architecture is enough for the training smoke test")
    drafter = make_drafter(target, top_k=32)  # a wide pool holds random labels often enough
    torch.manual_seed(0)
    sel = default_registry().create(name, drafter=drafter, config=tiny_selector_config(name))
    module = DraftTrainModule(drafter, sel).train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (4, 28), generator=g)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 4:] = True
    feats = target(ids, target.new_cache(4, 28), feature_layers=drafter.config.target_layer_ids).features
    before = {k: v.clone() for k, v in sel.state_dict().items()}
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    for step in range(3):
        out = training_step(
            module, module, ids, mask, feats, StepConfig(anchors_per_seq=6, native_fraction=0.5, progress=step / 3), g
        )
        assert math.isfinite(out.loss.item()) and out.metrics["loss/selector"] > 0
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    assert {"selector/acc", "selector/native_acc", "pool/coverage"} <= out.metrics.keys()
    still = [k for k, v in sel.state_dict().items() if torch.equal(v, before[k])]
    assert not still, f"{name}: parameters that never moved: {still}"
