"""The shipped CPU default (platform/serve/smollm2-135m.yaml: SmolLM2-135M + bundled drafter + DRelay)
on a real Ray Serve instance, at its cost-aware verification length (the cost surface measured at the
replica's first start): greedy chat output equals the offline engine's, sglext matches usage."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import requests

openai = pytest.importorskip("openai")

CONFIG = Path(__file__).resolve().parents[2] / "platform" / "serve" / "smollm2-135m.yaml"


@pytest.mark.slow
def test_cpu_default_endpoint_matches_offline_engine(ray_session, smol):
    from ray import serve

    from deploy.serve.commands import start
    from deploy.serve.config import load_serve_config
    from drelay_model.decoding import GenerationConfig, SpeculativeEngine
    from pipelines.common.methods import load_method, resolve_method

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = load_serve_config(CONFIG, {"port": port, "auth": {}})
    url = start(cfg, name="drelay-smollm2")
    try:
        deadline = time.time() + 600
        while time.time() < deadline:
            try:
                if requests.get(f"{url}/ready", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(2)
        question = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did she sell altogether?"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
        out = client.chat.completions.create(
            model=cfg.model_id,
            messages=[{"role": "user", "content": question}],
            max_tokens=48,
            temperature=0,
            extra_body={"return_spec_tokens_details": True},
        )
        assert cfg.engine.target == "smollm2-135m"
        target = smol  # the suite's one loaded SmolLM2 (tests/conftest.py), the replica's target
        drafter, selector = load_method(
            resolve_method(cfg.engine.method, target_spec=cfg.engine.target, checkpoint=cfg.engine.checkpoint), target
        )
        ids = target.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
        )
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        offline = SpeculativeEngine(target, drafter, selector).generate([ids], GenerationConfig(max_new_tokens=48))
        assert out.choices[0].message.content == target.tokenizer.decode(offline.tokens[0], skip_special_tokens=True)
        ext = out.model_extra["sglext"]
        assert ext["method"] == "drelay" and out.usage.completion_tokens == len(offline.tokens[0])
        assert ext["spec_accept_length"] == pytest.approx(out.usage.completion_tokens / ext["spec_verify_ct"])
        # The shipped config verifies at the cost-aware length, which learns from the rounds it times:
        # the rounds differ from the offline engine's whole-path rounds, the tokens do not.
        assert cfg.engine.verify_length == "cost"
        assert 0 <= ext["spec_drafted_ct"] <= ext["spec_verify_ct"] <= out.usage.completion_tokens
        assert 0 <= ext["spec_verify_length"] <= offline.stats.num_slots
    finally:
        serve.shutdown()
