"""The exported draft model as SGLang 0.5.23 builds, loads and runs it, by SGLang's own code: the
draft ModelConfig at the Qwen3 targets' context length, `DRelayDraftModel` constructed from the
`Qwen3Config` object and loaded through `DefaultModelLoader`, a quantized target's draft, and the
memory of the draft step that runs in the captured graph every round."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytestmark = pytest.mark.sglang_cpu

QWEN3_CONTEXT = {"Qwen3-4B": 40960, "Qwen3-8B": 40960}  # their config.json's max_position_embeddings


@pytest.mark.parametrize("name", sorted(QWEN3_CONTEXT))
def test_draft_model_config_accepts_the_qwen3_targets_context_length(drelay_registered, dirs, server_args, tmp_path, name):
    """What the draft worker builds: `ModelConfig.from_server_args(…, is_draft_model=True,
    context_length=<the target ModelConfig's context_len>)` (`build_draft_tp_worker`). SGLang
    refuses a target context above the draft config's own, which must therefore be the target's."""
    from sglang.srt.configs.model_config import ModelConfig

    from deploy.sglang.export import export_sglang

    n = QWEN3_CONTEXT[name]
    target = tmp_path / "target"
    shutil.copytree(dirs["target"], target)
    cfg = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": n}))
    draft = export_sglang(dirs["ckpt"], tmp_path / "draft", context_length=n)
    args = server_args(model_path=str(target), speculative_draft_model_path=str(draft))
    args.resolve_once()
    target_config = ModelConfig.from_server_args(args)
    assert target_config.context_len == n
    draft_config = ModelConfig.from_server_args(
        args, model_path=str(draft), is_draft_model=True, context_length=target_config.context_len
    )
    assert draft_config.context_len == n and draft_config.hf_config.architectures == ["DRelayDraftModel"]
    ModelConfig(model_path=str(draft), context_length=n, is_draft_model=True)  # the direct form, too


def _load_draft(args, path):
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import DefaultModelLoader, get_model_loader

    config = ModelConfig.from_server_args(args, model_path=str(path), is_draft_model=True, context_length=1024)
    loader = get_model_loader(LoadConfig(), config)
    assert type(loader) is DefaultModelLoader
    return config, loader.load_model(model_config=config, device_config=DeviceConfig("cpu"))


def test_draft_model_is_built_from_a_qwen3config_and_loaded_by_sglangs_loader(published, dirs):
    """SGLang's loader hands the model class the `Qwen3Config` object AutoConfig read (not a dict)
    and feeds it every exported tensor; the result equals the export tensor for tensor, in the
    config's dtype, with one RadixAttention per layer."""
    from safetensors.torch import load_file
    from sglang.srt.layers.radix_attention import RadixAttention
    from transformers import Qwen3Config

    from deploy.sglang.models.drelay_draft import DRelayDraftModel

    config, model = _load_draft(published, dirs["draft"])
    assert isinstance(config.hf_config, Qwen3Config) and type(model) is DRelayDraftModel
    assert model.fc.weight.dtype == config.dtype == torch.bfloat16
    assert all(isinstance(layer.self_attn.attn, RadixAttention) for layer in model.layers)
    own = dict(model.named_parameters()) | dict(model.named_buffers()) | model.extra_tensors
    saved = load_file(str(dirs["draft"] / "model.safetensors"))
    assert set(saved) <= set(own)
    for name, tensor in saved.items():
        assert torch.equal(own[name], tensor), name


def test_a_quantized_target_gets_an_unquantized_draft(drelay_registered, dirs, server_args):
    """SGLang gives the draft the target's `--quantization` unless told otherwise; DRELAY's argument
    check keeps the draft unquantized (its export is plain weights), and refuses an explicitly
    quantized draft in one line. DFLASH is left as SGLang has it."""
    from sglang.srt.configs.model_config import ModelConfig

    args = server_args(quantization="fp8")
    args.resolve_once()
    resolved = args.resolved_dict()
    assert resolved["quantization"] == "fp8" and resolved["speculative_draft_model_quantization"] is None
    draft = ModelConfig.from_server_args(args, model_path=str(dirs["draft"]), is_draft_model=True, context_length=1024)
    assert draft.quantization is None
    dflash = server_args("DFLASH", quantization="fp8")
    dflash.resolve_once()
    assert dflash.resolved_dict()["speculative_draft_model_quantization"] == "fp8"
    explicit = server_args(quantization="fp8", speculative_draft_model_quantization="fp8")
    with pytest.raises(ValueError, match="DRELAY drafts run unquantized") as exc:
        explicit.resolve_once()
    assert "\n" not in str(exc.value)


def test_draft_step_never_holds_a_full_vocabulary_float32_tensor(published, dirs, monkeypatch):
    """`compute_candidates` (called inside the captured draft graph every round): the pool and
    log q equal the full float32 log-softmax's, while no float32 tensor of N × V elements (8·N·V
    bytes for log-softmax's input and output) is ever made."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from deploy.sglang import runner_math

    monkeypatch.setattr(runner_math, "LSE_CHUNK", 64)  # V = 256 here: four chunks
    _, model = _load_draft(published, dirs["draft"])
    head = torch.nn.Linear(64, 256, bias=False).to(torch.bfloat16)
    model.lm_head = head
    hidden = torch.randn(3 * 15, 64).to(torch.bfloat16)  # N = bs·H
    hidden[1] = hidden[0]  # identical rows, and ties inside a row's logits
    head.weight.data[7] = head.weight.data[3]

    class Largest(TorchDispatchMode):
        biggest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    Largest.biggest = max(Largest.biggest, t.numel())
            return out

    with Largest():
        ids, logq = model.compute_candidates(hidden)
    N, V = hidden.shape[0], 256
    assert Largest.biggest <= N * 64 < N * V
    full = torch.log_softmax(torch.nn.functional.linear(hidden, model._draft_head).float(), dim=-1)
    ref_logq, ref_ids = full.topk(model.drafter_config.top_k, dim=-1)
    assert torch.equal(ids, ref_ids) and torch.allclose(logq, ref_logq, atol=1e-5, rtol=0)
