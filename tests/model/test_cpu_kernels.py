"""CPU kernel choices are settings of the models that pack (`CpuKernels`), never process state: models
with different settings run side by side, the environment only supplies the default, and a bad
value there is a one-line error naming the variable."""

from __future__ import annotations

import pytest
import torch

from drelay_model.decoding import GenerationConfig, SpeculativeEngine
from drelay_model.errors import DRelayError
from drelay_model.kernels import cpu_linear
from drelay_model.kernels.cpu_linear import CpuKernels, PackedLinear
from drelay_model.selectors import default_registry
from drelay_model.target import tiny_target

needs_onednn = pytest.mark.skipif(not cpu_linear.available(), reason="this PyTorch build has no oneDNN packed linear")


def test_settings_come_from_the_environment_and_bad_values_name_the_variable():
    assert CpuKernels.from_env({}) == CpuKernels()
    assert CpuKernels.from_env({"DRELAY_INT8_DRAFT": "0", "DRELAY_BF16_POOL": "1"}) == CpuKernels(int8_draft=False)
    assert CpuKernels.from_env({"DRELAY_PACKED_LINEARS": "0"}).packed is False
    with pytest.raises(DRelayError, match="DRELAY_BF16_POOL must be 0 or 1, got 'yes'"):
        CpuKernels.from_env({"DRELAY_BF16_POOL": "yes"})


def test_what_takes_effect_and_the_cache_tag():
    """Nothing applies off float32 CPU weights or with packing off; the tag names what does."""
    off = CpuKernels(packed=False, bf16_pool=False, int8_draft=False)
    assert CpuKernels().active("cpu", torch.float64) == off and CpuKernels().active("meta", torch.float32) == off
    assert CpuKernels(packed=False).active("cpu", torch.float32) == off and off.cache_tag() == "" and off.rank_dtype() is None
    assert CpuKernels(bf16_pool=False).cache_tag() == "-packed-rank-int8-int8-blocks"
    assert CpuKernels().cache_tag() == "-packed-rank-bfloat16-int8-blocks"
    assert CpuKernels(bf16_pool=False, int8_draft=False).cache_tag() == "-packed"
    assert "F.linear throughout" in CpuKernels(packed=False).describe("cpu", torch.float32)
    assert CpuKernels().describe("cpu", torch.float32).count("\n") == 0


@needs_onednn
def test_a_target_packs_with_its_settings_and_its_drafter_and_selector_take_them(make_drafter):
    plain = tiny_target("tiny-llama", cpu_kernels=CpuKernels(packed=False))
    assert not plain.pack_linears() and not plain.packed
    packed = tiny_target("tiny-llama", cpu_kernels=CpuKernels())
    assert packed.pack_linears() and packed.packed
    drafter = make_drafter(plain)
    assert drafter.cpu_kernels == plain.cpu_kernels and drafter.fc.cpu_kernels == plain.cpu_kernels
    selector = default_registry().create("drelay", drafter=drafter)
    linears = [m for m in selector.modules() if isinstance(m, PackedLinear)]
    assert linears and all(m.cpu_kernels == plain.cpu_kernels for m in linears)
    own = make_drafter(plain, cpu_kernels=CpuKernels(int8_draft=False))  # a drafter may be given its own
    assert own.cpu_kernels == CpuKernels(int8_draft=False) and SpeculativeEngine(plain, own).cpu_kernels == own.cpu_kernels


@needs_onednn
def test_models_with_other_settings_run_side_by_side_and_stay_lossless(prompts_of, make_drafter, scripted_selector):
    """A packed and an unpacked stack in one process: each decodes speculatively exactly what it
    decodes autoregressively, and a packed linear runs packed only under settings that allow it."""
    cfg = GenerationConfig(max_new_tokens=12)
    for kernels in (CpuKernels(packed=False), CpuKernels()):
        target = tiny_target("tiny-qwen3", cpu_kernels=kernels)
        target.pack_linears()
        prompts = prompts_of(target.vocab_size, (5, 8))
        ar = SpeculativeEngine(target).generate(prompts, cfg).tokens
        selector = scripted_selector([p + a for p, a in zip(prompts, ar)], vocab=target.vocab_size)
        assert SpeculativeEngine(target, make_drafter(target), selector).generate(prompts, cfg).tokens == ar
    lin_off, lin_on = PackedLinear(8, 5, cpu_kernels=CpuKernels(packed=False)), PackedLinear(8, 5)
    with torch.no_grad():
        lin_off(torch.randn(2, 8)), lin_on(torch.randn(2, 8))
    assert lin_off._pack._packed is None and lin_on._pack._packed is not None


@pytest.mark.skipif(not cpu_linear.available(), reason="oneDNN's packed linear is not in this torch build")
def test_rows_invariant_gives_each_row_what_a_large_call_gives_it():
    """A few-row call padded by `rows_invariant` equals, bit for bit, the same rows of a 1,024-row call
    (unpadded, an AVX-512 CPU rounds a single row through 1,536 inputs differently), for a tensor and
    a tuple of outputs."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(256, 1536, generator=g), torch.randn(256, generator=g)
    packed = cpu_linear.pack(w, CpuKernels())
    x = torch.randn(1024, 1536, generator=g)
    with torch.no_grad():  # the packed path is inference-only
        full = cpu_linear.linear(x, w, b, packed)
        for m in range(1, cpu_linear.INVARIANT_ROWS + 2):
            one = cpu_linear.rows_invariant(lambda r: cpu_linear.linear(r, w, b, packed), x[:m])
            assert one.shape == (m, 256) and torch.equal(one, full[:m])
            pair = cpu_linear.rows_invariant(lambda r: (cpu_linear.linear(r, w, b, packed), r.sum(-1)), x[:m])
            assert torch.equal(pair[0], full[:m]) and torch.equal(pair[1], x[:m].sum(-1))
