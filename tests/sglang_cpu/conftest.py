"""Tests marked `sglang_cpu` run against SGLang 0.5.23's real modules on CPU, in the SGLang venv
(`make sglang-env`, `make test-sglang`); elsewhere they skip. SGLang reads the plugin whitelist and
the external model package from the environment when it loads them, so both are set here, before
any test imports sglang."""

from __future__ import annotations

import importlib.util
import os

import pytest

HAS_SGLANG = importlib.util.find_spec("sglang") is not None
if HAS_SGLANG:
    os.environ.setdefault("SGLANG_PLUGINS", "drelay")
    os.environ.setdefault("SGLANG_EXTERNAL_MODEL_PACKAGE", "deploy.sglang.models")


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="sglang is not importable here: run `make test-sglang` (SGLang's own venv)")
    for item in items:
        if "sglang_cpu" in item.keywords and not HAS_SGLANG:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def drelay_registered():
    """DRELAY registered the way an SGLang process registers it: `load_plugins()` with SGLANG_PLUGINS."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    load_plugins()
    return SpeculativeAlgorithm.from_string("DRELAY")


@pytest.fixture(scope="session")
def dirs(tmp_path_factory):
    """A tiny Qwen3 target saved as an HF directory and a DRelay export (drafter + drelay selector)
    for it, made with our own export command."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from deploy.sglang.export import export_sglang
    from drelay_model.drafter import BlockDrafter, DrafterConfig, save_drafter
    from drelay_model.selectors import default_registry
    from drelay_model.target import load_target

    root = tmp_path_factory.mktemp("sglang_cpu")
    cfg = Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(root / "target")
    target = load_target(str(root / "target"), pack=False)
    drafter = BlockDrafter(DrafterConfig.for_target(target, num_layers=1, top_k=4, target_layer_ids=(0, 1, 2)), target).eval()
    sel = (
        default_registry()
        .create(
            "drelay",
            drafter=drafter,
            config={"d_sel": 32, "heads": 4, "read_dim": 16, "history_len": 8, "compact_dim": 16, "ffn_mult": 2},
        )
        .eval()
    )
    extra = {f"selector.{k}": v for k, v in sel.state_dict().items()}
    save_drafter(
        drafter, root / "ckpt", extra_tensors=extra, meta={"selector": {"name": "drelay", "config": sel.config.to_dict()}}
    )
    export_sglang(root / "ckpt", root / "draft", context_length=1024)
    return {"target": root / "target", "draft": root / "draft", "ckpt": root / "ckpt", "embed": target.embed_weight}


def _server_args(dirs, algorithm: str = "DRELAY", **overrides):
    """ServerArgs with the documented DRELAY flags (device `cuda`: DFLASH's handler refuses the CPU;
    argument handling itself needs no GPU)."""
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(
        **{
            "model_path": str(dirs["target"]),
            "speculative_algorithm": algorithm,
            "device": "cuda",
            "random_seed": 0,
            "speculative_draft_model_path": str(dirs["draft"]),
            "speculative_num_draft_tokens": 16,
            "skip_tokenizer_init": True,
            **overrides,
        }
    )


@pytest.fixture()
def server_args(dirs):
    """server_args(algorithm="DRELAY", **overrides) → unresolved ServerArgs for the test export."""
    return lambda algorithm="DRELAY", **overrides: _server_args(dirs, algorithm, **overrides)


@pytest.fixture()
def published(drelay_registered, dirs):
    """SGLang's runtime context for a scheduler process of rank 0 with the DRELAY server args, as
    the scheduler publishes it (scoped to the test: the process-wide context is left alone)."""
    from sglang.srt.runtime_context import SpawnRanks, create_context, use_context

    args = _server_args(dirs)
    args.resolve_once()
    with use_context(create_context(args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))):
        yield args
