"""The `sglang` backend: command line and stream parsing (pure), and a live server (GPU + sglang only)."""

from __future__ import annotations

import os

import pytest

from deploy.serve.backends.base import GenRequest
from deploy.serve.backends.sglang import chunk_from_event, context_window, launch_command, sampling_params, server_env
from deploy.serve.config import load_serve_config
from drelay_model.decoding import GenerationConfig
from drelay_model.errors import DRelayError
from pathlib import Path

QWEN = Path(__file__).resolve().parents[2] / "platform" / "serve" / "qwen3-4b.yaml"


def test_launch_command_enables_drelay():
    cmd = launch_command(load_serve_config(QWEN).sglang, python="/opt/sglang/bin/python", draft="/d", context_length=40960)
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    assert cmd[cmd.index("--speculative-algorithm") + 1] == "DRELAY"
    # top-k 1 up front: SGLang's args then resolve as DFLASH's on Blackwell too (tests/sglang_cpu)
    assert cmd[cmd.index("--speculative-eagle-topk") + 1] == "1"
    assert cmd[cmd.index("--port") + 1] == "30000"


def test_stream_events_keep_spec_statistics():
    chunk, sent = chunk_from_event({"output_ids": [5, 6, 7], "meta_info": {"finish_reason": None}}, 1)
    assert chunk.token_ids == [6, 7] and sent == 3 and chunk.finish_reason is None and chunk.spec is None
    meta = {
        "finish_reason": {"type": "length"},
        "completion_tokens": 4,
        "spec_verify_ct": 2,
        "spec_correct_drafts_histogram": [0, 1, 1],
        "spec_accept_rate": 0.1,
        "spec_num_correct_drafts": 3,
    }
    chunk, sent = chunk_from_event({"output_ids": [5, 6, 7, 8], "meta_info": meta}, 3)
    assert chunk.token_ids == [8] and chunk.finish_reason == "length"
    assert chunk.spec.verify_ct == 2 and chunk.spec.accept_length == 2.0 and chunk.spec.accept_histogram == [0, 1, 1]
    assert sampling_params(GenRequest(prompt_ids=[1], settings=GenerationConfig(max_new_tokens=3)))["top_k"] == -1


def test_server_env_carries_plugin_package_and_gpus():
    env = server_env({"PATH": "/bin", "SGLANG_PLUGINS": "other"}, gpu_ids=["2", "3"])
    assert env["SGLANG_PLUGINS"] == "other,drelay" and env["SGLANG_EXTERNAL_MODEL_PACKAGE"] == "deploy.sglang.models"
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["PATH"] == "/bin"
    assert env["PYTHONPATH"].split(":")[0] == str(Path(__file__).resolve().parents[2])  # this checkout's plugin
    with pytest.raises(DRelayError, match="^num_gpus: "):
        server_env({}, gpu_ids=[])


def test_context_window_is_the_target_config_length(tmp_path):
    from transformers import Qwen3Config

    Qwen3Config(max_position_embeddings=40960, num_hidden_layers=1).save_pretrained(tmp_path)
    assert context_window(str(tmp_path)) == 40960


@pytest.mark.sglang
@pytest.mark.skipif(
    not os.environ.get("DRELAY_SGLANG_PYTHON"), reason="needs SGLang's interpreter (DRELAY_SGLANG_PYTHON) and a GPU"
)
def test_live_sglang_server_returns_spec_stats():  # pragma: no cover - GPU hosts only
    import asyncio

    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from deploy.serve.backends.sglang import SGLangBackend

    cfg = load_serve_config(QWEN)
    backend = SGLangBackend(cfg.sglang, cfg.limits)
    try:
        ids = backend.tokenizer("The capital of France is")["input_ids"]

        async def run():
            return [c async for c in backend.submit(GenRequest(prompt_ids=ids, settings=GenerationConfig(max_new_tokens=32)))]

        chunks = asyncio.run(run())
        spec = chunks[-1].spec
        assert sum(len(c.token_ids) for c in chunks) == spec.completion_tokens == 32
        assert spec.verify_ct >= 1 and spec.accept_length == pytest.approx(32 / spec.verify_ct)
    finally:
        backend.shutdown()
