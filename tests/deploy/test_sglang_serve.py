"""The `sglang` serve backend's start: the draft from the MLflow registry (`models:/name@alias`),
exported to SGLang's format once per version; and the real `sglang.launch_server` started from
SGLang's own venv with our plugin on this CPU, stopping only where SGLang needs a CUDA device.

The launch test is marked `sglang_cpu` and runs from this project's venv (the replica's) with
DRELAY_SGLANG_PYTHON naming SGLang's interpreter (`make test-sglang`); it is skipped otherwise."""

from __future__ import annotations

import json
import os
import socket
import subprocess

import pytest
import torch

from deploy.serve.backends.sglang import SGLangBackend, launch_command
from deploy.serve.config import LimitsSection, SGLangSection
from deploy.sglang.draft_source import resolve_draft
from drelay_model.drafter import BlockDrafter, DrafterConfig, save_drafter
from drelay_model.errors import DRelayError
from pipelines.common.outputs import OUTPUT_ROOT_ENV

QWEN3_4B_CONTEXT = 40960


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A tiny Qwen3 target on disk with Qwen3-4B's context length (SGLang loads it by path)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = tmp_path_factory.mktemp("target")
    cfg = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=QWEN3_4B_CONTEXT, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture
def registered(target_dir, tmp_path, uri, monkeypatch):
    """A training run's drafter/ artifact registered as `drelay-tiny-qwen3` (alias champion) in a
    fresh SQLite store; outputs (the registry and export caches) under tmp_path/root."""
    from drelay_model.target import load_target
    from pipelines.common.registry import register_checkpoint
    from pipelines.common.tracking import tracked_run

    monkeypatch.setenv(OUTPUT_ROOT_ENV, str(tmp_path / "root"))
    target = load_target(str(target_dir), pack=False)

    def train_and_register(seed: int) -> str:
        torch.manual_seed(seed)
        ckpt = tmp_path / f"train{seed}" / "drafter"
        save_drafter(BlockDrafter(DrafterConfig.for_target(target, num_layers=1, target_layer_ids=(0, 1, 2)), target), ckpt)
        with tracked_run("drelay-train", run_name=f"tiny-{seed}") as run:
            run.log_artifact(ckpt, artifact_path="drafter")
        return register_checkpoint(run.run_id, "drelay-tiny-qwen3")

    return train_and_register


def test_registry_draft_is_exported_once_per_version(registered, tmp_path):
    assert registered(0) == "1"
    cache = tmp_path / "root" / "cache" / "sglang" / "drelay-tiny-qwen3"
    first = resolve_draft("models:/drelay-tiny-qwen3@champion", context_length=QWEN3_4B_CONTEXT)
    assert first == cache / f"1-bfloat16-ctx{QWEN3_4B_CONTEXT}"
    doc = json.loads((first / "config.json").read_text())
    assert doc["architectures"] == ["DRelayDraftModel"] and doc["max_position_embeddings"] == QWEN3_4B_CONTEXT
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert resolve_draft("models:/drelay-tiny-qwen3@champion", context_length=QWEN3_4B_CONTEXT) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # cached: not exported again
    assert registered(1) == "2"  # champion moves: a new version, a new export
    assert resolve_draft("models:/drelay-tiny-qwen3@champion", context_length=QWEN3_4B_CONTEXT).name.startswith("2-")
    assert resolve_draft(str(first), context_length=QWEN3_4B_CONTEXT) == first  # an export is used as it is
    with pytest.raises(DRelayError, match=r"^sglang.draft_model_path: .*re-export with --context-length 65536") as exc:
        resolve_draft(str(first), context_length=65536)
    assert "\n" not in str(exc.value)
    with pytest.raises(DRelayError, match=r"^sglang.draft_model_path: .* neither"):
        resolve_draft(str(tmp_path), context_length=QWEN3_4B_CONTEXT)


def test_launch_command_names_sglangs_interpreter_device_and_context(target_dir):
    cfg = SGLangSection(model_path=str(target_dir), draft_model_path="models:/x@champion")
    cmd = launch_command(cfg, python="/opt/sglang/bin/python", draft="/cache/d", context_length=QWEN3_4B_CONTEXT)
    assert cmd[:3] == ["/opt/sglang/bin/python", "-m", "sglang.launch_server"]

    def value(flag: str) -> str:
        return cmd[cmd.index(flag) + 1]

    assert value("--device") == "cuda" and value("--context-length") == str(QWEN3_4B_CONTEXT)
    assert value("--speculative-draft-model-path") == "/cache/d" and "--skip-tokenizer-init" in cmd


def test_an_interpreter_without_sglang_is_one_line(target_dir, tmp_path):
    import sys

    cfg = SGLangSection(model_path=str(target_dir), draft_model_path="d", python=sys.executable)
    with pytest.raises(DRelayError, match="^sglang.python: .* has no sglang installed"):
        SGLangBackend(cfg, LimitsSection())
    cfg = SGLangSection(model_path=str(target_dir), draft_model_path="d", python=str(tmp_path / "nope"))
    with pytest.raises(DRelayError, match="^sglang.python: cannot run"):
        SGLangBackend(cfg, LimitsSection())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.sglang_cpu
@pytest.mark.skipif(not os.environ.get("DRELAY_SGLANG_PYTHON"), reason="needs SGLang's venv: run `make test-sglang`")
def test_backend_starts_sglang_from_its_venv_and_stops_only_at_the_device(registered, target_dir, tmp_path, monkeypatch):
    """The replica's start, for real: resolve `models:/…@champion`, export it, launch
    `sglang.launch_server` with SGLang's interpreter, the plugin's environment and the replica's GPU.
    SGLang's argument handling accepts DRELAY (plugin loaded in the server process), our check reads
    the draft config, the scheduler starts and stops at `torch.cuda.set_device` (no driver here);
    the backend reports it in one line and the server's process group is gone."""
    registered(0)
    started: list[subprocess.Popen] = []

    class Recorded(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr(subprocess, "Popen", Recorded)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # what Ray gives a replica with num_gpus: 1
    log = tmp_path / "sglang.log"
    cfg = SGLangSection(model_path=str(target_dir), draft_model_path="models:/drelay-tiny-qwen3@champion",
                        tokenizer="smollm2-135m", port=_free_port(), startup_timeout_s=480, log_file=str(log))  # fmt: skip
    with pytest.raises(DRelayError, match="exited with status .* during startup: .*NVIDIA driver") as exc:
        SGLangBackend(cfg, LimitsSection())
    assert "\n" not in str(exc.value)
    text = log.read_text()
    assert "'speculative_algorithm': 'DRELAY'" in text and "'speculative_num_steps': 1" in text  # resolved as DFLASH
    assert f"'context_length': {QWEN3_4B_CONTEXT}" in text
    assert f"context length {QWEN3_4B_CONTEXT}, selector None" in text and "DRELAY draft" in text  # our draft check
    assert "init_parallel_runtime" in text and "set_device" in text  # the scheduler, at the device
    errors = [line for line in text.splitlines() if line.startswith(("RuntimeError", "ValueError", "ModuleNotFoundError"))]
    assert errors and all("NVIDIA driver" in line for line in errors), errors
    [proc] = [p for p in started if "sglang.launch_server" in p.args]
    assert proc.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # the server's process group (scheduler, detokenizer) is gone


@pytest.mark.parametrize("size", ["4b", "8b"])
def test_qwen3_train_configs_register_the_drafter_their_serve_configs_serve(size):
    """`drelay train` with the Qwen3 config registers `drelay-qwen3-<size>` (alias champion); the
    serve config of the same target serves exactly that reference through SGLang."""
    from pathlib import Path

    from deploy.serve.config import load_serve_config
    from pipelines.train.config import load_config

    root = Path(__file__).resolve().parents[2] / "platform"
    train = load_config(root / "experiments" / f"qwen3-{size}" / "train.yaml")
    serve = load_serve_config(root / "serve" / f"qwen3-{size}.yaml")
    assert train.mlflow.registered_model == f"drelay-qwen3-{size}"
    assert serve.backend == "sglang" and serve.sglang.draft_model_path == f"models:/{train.mlflow.registered_model}@champion"
    assert serve.sglang.model_path == train.target.spec and serve.num_gpus >= 1
