"""Target adapter: our cached forward against Hugging Face's, per-row cache cropping, loading errors."""

from __future__ import annotations

import pytest
import torch

from drelay_model.errors import DRelayError
from drelay_model.target import load_target


def test_forward_matches_huggingface_logits_and_hidden_states(target, prompts_of):
    ids = torch.tensor(prompts_of(target.vocab_size, (20, 20)))
    ref = target.hf(ids, output_hidden_states=True)
    cache = target.new_cache(2, 64)
    first = target(ids[:, :12], cache, feature_layers=(1, 0))  # two chunks through the cache
    second = target(ids[:, 12:], cache)
    ours = torch.cat([first.logits, second.logits], dim=1)
    torch.testing.assert_close(ours, ref.logits, atol=1e-4, rtol=1e-4)
    # features = concatenated outputs of decoder layers 1 and 0, in the order asked for. (HF's last
    # hidden state is after the final norm, so only layer 0 compares to HF directly.)
    D = target.hidden_size
    torch.testing.assert_close(first.features[..., D:], ref.hidden_states[1][:, :12], atol=1e-4, rtol=1e-4)
    alone = target(ids[:, :12], target.new_cache(2, 64), feature_layers=(1,)).features
    torch.testing.assert_close(first.features[..., :D], alone, atol=1e-5, rtol=1e-5)


def test_cropped_cache_gives_the_logits_of_a_fresh_prefill(target, prompts_of):
    """Rows that rejected different numbers of drafts continue exactly as if never drafted."""
    prompts = prompts_of(target.vocab_size, (10, 10, 10))
    ids = torch.tensor(prompts)
    cache = target.new_cache(3, 64)
    target(ids, cache)
    junk = torch.randint(0, target.vocab_size, (3, 6))
    target(junk, cache)  # a rejected draft block
    keep = torch.tensor([10, 13, 16])  # row 0 rejects all, row 1 keeps 3 drafts, row 2 keeps all
    cache.crop(keep)
    nxt = torch.randint(0, target.vocab_size, (3, 2))
    after = target(nxt, cache).logits  # [3, 2, V]
    for b in range(3):
        seq = torch.cat([ids[b], junk[b, : keep[b] - 10], nxt[b]])[None]
        fresh = target.hf(seq).logits[0, -2:]
        torch.testing.assert_close(after[b], fresh, atol=1e-4, rtol=1e-4)


def test_right_padded_batch_equals_single_rows(target, prompts_of):
    prompts = prompts_of(target.vocab_size, (4, 11, 7))
    lengths = torch.tensor([len(p) for p in prompts])
    ids = torch.zeros(3, 11, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(p)
    cache = target.new_cache(3, 32)
    batched = target(ids, cache, logits_at=(lengths - 1)[:, None]).logits[:, 0]
    for b, p in enumerate(prompts):
        single = target.hf(torch.tensor([p])).logits[0, -1]
        torch.testing.assert_close(batched[b], single, atol=1e-4, rtol=1e-4)


def test_cache_capacity_is_a_clear_error(target):
    cache = target.new_cache(1, 8)
    with pytest.raises(DRelayError, match="capacity is 8"):
        target(torch.zeros(1, 9, dtype=torch.long), cache)


def test_crop_cannot_grow_a_row(target):
    cache = target.new_cache(2, 16)
    target(torch.zeros(2, 4, dtype=torch.long), cache)
    with pytest.raises(ValueError):
        cache.crop(torch.tensor([5, 2]))


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no-such-model", "unknown target 'no-such-model'"),
        ("tiny-llama:vocab=abc", "bad tiny target option"),
        ("tiny-llama:colour=3", "bad tiny target option"),
    ],
)
def test_bad_target_specs_name_the_problem(spec, message):
    with pytest.raises(DRelayError, match=message):
        load_target(spec)


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(DRelayError, match="has no config.json"):
        load_target(str(tmp_path))


def test_unsupported_architecture_is_rejected(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path)
    with pytest.raises(DRelayError, match="model_type 'gpt2' is not supported"):
        load_target(str(tmp_path))


def test_loads_a_hugging_face_directory(tmp_path, target, prompts_of):
    target.hf.save_pretrained(tmp_path / "model")
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    ).save_pretrained(tmp_path / "model")
    loaded = load_target(str(tmp_path / "model"))
    ids = torch.tensor(prompts_of(target.vocab_size, (9,)))
    torch.testing.assert_close(loaded(ids, loaded.new_cache(1, 16)).logits, target(ids, target.new_cache(1, 16)).logits)
    assert loaded.tokenizer is not None


# ---- pre-packed oneDNN linears (CPU, float32) ----------------------------------------------------
from drelay_model.kernels import cpu_linear  # noqa: E402


@pytest.fixture()
def packed_target():
    if not cpu_linear.available():
        pytest.skip("this PyTorch build has no oneDNN packed linear")
    from drelay_model.target import load_target

    return load_target("tiny-llama", cpu_kernels=cpu_linear.CpuKernels())  # load_target packs on CPU in float32


def test_packed_linears_match_the_eager_forward(packed_target, prompts_of):
    t = packed_target
    assert t.packed
    ids = torch.tensor(prompts_of(t.vocab_size, (9,)))
    runs = []
    for packed in (True, False):
        t.pack_linears() if packed else t.unpack_linears()
        cache = t.new_cache(1, 32)
        runs.append(t(ids, cache, feature_layers=(0, 1)))
    torch.testing.assert_close(runs[0].logits, runs[1].logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(runs[0].features, runs[1].features, atol=1e-4, rtol=1e-4)


def test_a_packed_row_does_not_depend_on_the_rows_beside_it(packed_target):
    """One row alone (an AR step) and the same row first of 16 (a verify) give identical outputs:
    the packed weight is read the same way for any number of rows."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    x = torch.randn(16, 64, generator=g)
    packed = cpu_linear.pack(w, cpu_linear.CpuKernels())
    with torch.no_grad():
        alone, batch = cpu_linear.linear(x[:1], w, b, packed), cpu_linear.linear(x, w, b, packed)
    assert torch.equal(alone[0], batch[0])
    torch.testing.assert_close(batch, torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-4)


def test_packing_steps_aside_off_its_path(packed_target):
    """Moving the model drops the packs; bf16 autocast and autograd use F.linear."""
    import copy

    w = torch.randn(8, 4)
    packed = cpu_linear.pack(w, cpu_linear.CpuKernels())
    x = torch.randn(3, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert cpu_linear.linear(x, w, None, packed).dtype == torch.bfloat16  # autocast: F.linear
    xg = x.clone().requires_grad_(True)
    cpu_linear.linear(xg, w, None, packed).sum().backward()  # autograd: F.linear (the packed op has none)
    assert xg.grad is not None
    moved = copy.deepcopy(packed_target).to(torch.float64)
    assert not moved.packed
    assert cpu_linear.pack(w.double(), cpu_linear.CpuKernels()) is None


def test_speculative_decoding_on_a_packed_target_is_lossless(packed_target, prompts_of, make_drafter, scripted_selector):
    """A mostly right path (every accepted length occurs) verified 16 tokens at a time by the packed
    target gives exactly the packed target's own AR tokens."""
    from drelay_model.decoding import GenerationConfig, SpeculativeEngine

    t = packed_target
    prompts = prompts_of(t.vocab_size, (5, 9, 3))
    cfg = GenerationConfig(max_new_tokens=24)
    ar = SpeculativeEngine(t).generate(prompts, cfg).tokens
    selector = scripted_selector([p + a for p, a in zip(prompts, ar)], error_rate=0.15, vocab=t.vocab_size)
    spec = SpeculativeEngine(t, make_drafter(t), selector).generate(prompts, cfg)
    assert spec.tokens == ar and spec.stats.tau > 2.0


def test_packed_linear_follows_weight_updates_and_keeps_the_state_dict(packed_target):
    """A drafter's linears are trained between inference calls: the packed copy must follow."""
    lin = cpu_linear.PackedLinear(8, 5)
    assert set(lin.state_dict()) == {"weight", "bias"}  # checkpoints and exports see an nn.Linear
    x = torch.randn(4, 8)
    with torch.inference_mode():
        before = lin(x)
    torch.testing.assert_close(before, torch.nn.functional.linear(x, lin.weight, lin.bias))
    opt = torch.optim.SGD(lin.parameters(), lr=0.5)
    lin(x).sum().backward()  # training: F.linear (autograd)
    opt.step()  # an in-place update
    with torch.inference_mode():
        after = lin(x)
    torch.testing.assert_close(after, torch.nn.functional.linear(x, lin.weight, lin.bias).detach())
    assert not torch.allclose(before, after)


def test_packed_linear_built_under_inference_mode_runs_unpacked(packed_target):
    """A module built inside `torch.inference_mode()` has weights without a version counter: it must
    still run (plain F.linear) and follow an in-place update made there."""
    with torch.inference_mode():
        lin = cpu_linear.PackedLinear(8, 5)
        x = torch.randn(4, 8)
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
        lin.weight.mul_(2.0)
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))


def test_a_target_config_loads_without_weights():
    from drelay_model.target.loading import load_target_config

    config = load_target_config("tiny-qwen3:layers=3")
    assert (config.model_type, config.num_hidden_layers, config.max_position_embeddings) == ("qwen3", 3, 1024)
    with pytest.raises(DRelayError, match="unknown target 'no-such-model'"):
        load_target_config("no-such-model")
