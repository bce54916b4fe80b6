"""Device and dtype end to end: every tensor of the target moves with `.to()`, the engine allocates on
the target's device, sampling is per request, bad device names are clear errors."""

from __future__ import annotations

import pytest
import torch

from drelay_model.decoding import GenerationConfig, SpeculativeEngine
from drelay_model.device import resolve_device, resolve_dtype
from drelay_model.errors import DRelayError
from drelay_model.selectors import default_registry
from drelay_model.target import load_target, tiny_target


def _all_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen3"])
def test_every_target_tensor_moves_with_to(arch):
    target = tiny_target(arch)
    names = set(_all_tensors(target))
    assert {"_rope_cos", "_rope_sin", "_layers.0.qkv", "_layers.1.gate_up"} <= names
    moved = target.to("meta")
    assert all(t.device.type == "meta" for t in _all_tensors(moved).values())
    assert all(layer.qkv.is_meta and layer.o.is_meta and layer.in_norm.is_meta for layer in moved._layers)
    assert moved.device.type == "meta"


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen3"])
def test_dtype_round_trip_casts_fused_weights_and_rope(arch, prompts_of):
    target = tiny_target(arch)
    ids = torch.tensor(prompts_of(target.vocab_size, (9,)))
    target.to(torch.bfloat16)
    floats = [t for t in _all_tensors(target).values() if t.is_floating_point()]
    assert floats and all(t.dtype == torch.bfloat16 for t in floats)
    assert target.new_cache(1, 4).k.dtype == torch.bfloat16
    target.to(torch.float32)  # back: the fused copies went through the same casts as HF's weights
    torch.testing.assert_close(target(ids, target.new_cache(1, 16)).logits, target.hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_load_target_device_and_dtype():
    target = load_target("tiny-qwen3", device="cpu", dtype="bfloat16")
    assert target.dtype == torch.bfloat16 and target.device == torch.device("cpu")
    assert target._layers[0].qkv.dtype == torch.bfloat16 and target._rope_cos.dtype == torch.bfloat16
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
@pytest.mark.parametrize("name", ["cuda", "cuda:0"])
def test_cuda_without_cuda_is_a_clear_error(name):
    with pytest.raises(DRelayError, match="CUDA is not available"):
        resolve_device(name)
    with pytest.raises(DRelayError, match="CUDA is not available"):
        load_target("tiny-llama", device=name)


def test_bad_device_and_dtype_names():
    with pytest.raises(DRelayError, match="device must be one of"):
        resolve_device("tpu")
    with pytest.raises(DRelayError, match="dtype must be one of"):
        resolve_dtype("int8")


def test_engine_refuses_a_drafter_on_another_device(make_drafter):
    target = tiny_target("tiny-llama")
    drafter = make_drafter(target).to("meta")
    with pytest.raises(DRelayError, match="drafter is on"):
        SpeculativeEngine(target, drafter)


def _greedy_up_to_ties(target, prompt: list[int], out: list[int], tol: float) -> bool:
    """Every generated token is an argmax of the target's own logits (one teacher-forced HF forward)
    up to `tol`: in bf16, verify(16) and decode(1) round differently, so exact ties may break either way."""
    logits = target.hf(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1].float()  # [T, V]
    chosen = logits.gather(1, torch.tensor(out)[:, None])[:, 0]
    return bool((chosen >= logits.max(dim=1).values - tol).all())


@pytest.mark.parametrize("method", ["ar", *default_registry().names()])
def test_bf16_target_every_selector_emits_the_targets_greedy_tokens(make_drafter, prompts_of, tiny_selector_config, method):
    """Lossless in bf16: every selector's output is the bf16 target's greedy continuation (ties aside);
    where AR and speculative agree on a prefix, the rest follows; any wrong accepted draft would fail."""
    target = load_target("tiny-qwen3", dtype="bfloat16")
    prompts = prompts_of(target.vocab_size, (5, 9, 3))
    cfg = GenerationConfig(max_new_tokens=24)
    engine = SpeculativeEngine(target)
    if method != "ar":
        drafter = make_drafter(target).to(torch.bfloat16)
        selector = default_registry().create(method, drafter=drafter, config=tiny_selector_config(method))
        engine = SpeculativeEngine(target, drafter, selector.to(torch.bfloat16))
    for prompt, out in zip(prompts, engine.generate(prompts, cfg).tokens):
        assert len(out) == 24 and _greedy_up_to_ties(target, prompt, out, tol=0.15)


@pytest.mark.parametrize("speculative", [False, True], ids=["ar", "speculative"])
def test_sampled_output_does_not_depend_on_the_batch(target, make_drafter, prompts_of, speculative):
    drafter = make_drafter(target) if speculative else None
    engine = SpeculativeEngine(target, drafter)
    prompts = prompts_of(target.vocab_size, (5, 8, 6, 11))
    cfg = GenerationConfig(max_new_tokens=20, temperature=1.0)
    batch = engine.generate(prompts, cfg, seeds=[11, 12, 13, 14]).tokens
    alone = [engine.generate([p], cfg, seeds=[s]).tokens[0] for p, s in zip(prompts, [11, 12, 13, 14])]
    assert batch == alone
    reordered = engine.generate(prompts[::-1], cfg, seeds=[14, 13, 12, 11]).tokens
    assert reordered[::-1] == batch
    assert len({tuple(t) for t in engine.generate([prompts[0]] * 4, cfg).tokens}) > 1  # default seeds differ per row
    with pytest.raises(DRelayError, match="seeds has 1 entries"):
        engine.generate(prompts, cfg, seeds=[1])
