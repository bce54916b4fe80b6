"""`logprobs` / `top_logprobs` on the OpenAI routes without Ray: the Service over the real engine
backend (a tiny random Llama with SmolLM2's tokenizer, untrained drafter, native selector). Values
equal the target's own log_softmax over prompt + completion; the bodies and streamed chunks parse
as the official `openai` client's types; bad values are 400s naming the field. The SGLang backend's
request body and its stream's logprob fields (SGLang's `meta_info` names) are checked as parsing."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from deploy.serve.backends.base import GenRequest
from deploy.serve.backends.engine import EngineBackend
from deploy.serve.backends.sglang import chunk_from_event, request_body, server_env
from deploy.serve.config import parse_config
from deploy.serve.protocol import ApiError
from deploy.serve.service import Service
from drelay_model.decoding import GenerationConfig

openai = pytest.importorskip("openai")
from openai._models import construct_type  # noqa: E402  (how the client builds streamed chunks)

MODEL = "t"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 10, "temperature": 0}
COMPLETION = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 10, "temperature": 0}


@pytest.fixture(scope="module")
def service():
    cfg = parse_config(
        {
            "model_id": MODEL,
            "engine": {
                "target": "tiny-llama:vocab=49152",
                "tokenizer": "smollm2-135m",
                "method": "native",
                "random_drafter": True,
                "max_batch": 2,
                "verify_length": "fixed",
            },
            "limits": {"max_tokens": 64, "default_max_tokens": 16, "max_waiting": 4},
        }
    )
    backend = EngineBackend(cfg.engine, cfg.limits)
    service = Service(cfg, backend)
    service.loop = asyncio.new_event_loop()  # one loop for the module, as a replica's (open while the backend runs)
    yield service
    backend.shutdown()
    service.loop.close()


def _call(service: Service, route: str, body: dict):
    """A non-streamed body, or the streamed chunks (the `data:` objects before [DONE])."""

    async def run():
        out = await service.generate(route, json.dumps(body).encode())
        if isinstance(out, dict):
            return out
        return [json.loads(line[6:]) async for line in out if line != "data: [DONE]\n\n"]

    return service.loop.run_until_complete(run())


def _reference(service: Service, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    """[n, V] the target's log_softmax at each completion token's position (one full forward)."""
    target = service.backend.engine.target
    with torch.inference_mode():
        logits = target.hf(torch.tensor([prompt_ids + completion_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(completion_ids)]


def test_chat_logprobs_equal_the_targets_forward_streamed_and_not(service):
    body = {**CHAT, "logprobs": True, "top_logprobs": 3}
    whole = _call(service, "chat", body)
    parsed = openai.types.chat.ChatCompletion.model_validate(whole)
    content = parsed.choices[0].logprobs.content
    assert len(content) == parsed.usage.completion_tokens == 10
    tok = service.backend.tokenizer
    prompt_ids = tok.apply_chat_template(CHAT["messages"], add_generation_prompt=True, tokenize=True)
    prompt_ids = list(prompt_ids["input_ids"] if hasattr(prompt_ids, "keys") else prompt_ids)
    ids = service.backend.engine.generate([prompt_ids], GenerationConfig(max_new_tokens=10)).tokens[0]  # greedy: the same
    assert [(c.token, c.bytes) for c in content] == [service.token_texts(i) for i in ids]
    ref = _reference(service, prompt_ids, ids)
    want = ref.gather(1, torch.tensor(ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor([c.logprob for c in content]), want, atol=1e-4, rtol=0)
    for j, c in enumerate(content):
        assert bytes(c.bytes).decode("utf-8", errors="replace") == c.token
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token  # greedy: the argmax
        torch.testing.assert_close(torch.tensor([t.logprob for t in c.top_logprobs]), ref[j].topk(3).values, atol=1e-4, rtol=0)

    chunks = _call(service, "chat", {**body, "stream": True})
    parsed_chunks = [openai.types.chat.ChatCompletionChunk.model_validate(c) for c in chunks]
    streamed = [e for c in parsed_chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert [(e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in streamed] == [
        (e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in content
    ]
    torch.testing.assert_close(torch.tensor([e.logprob for e in streamed]), want, atol=1e-4, rtol=0)


def test_completions_logprobs_streamed_and_not(service):
    body = {**COMPLETION, "logprobs": 2}
    whole = openai.types.Completion.model_validate(_call(service, "completions", body))
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    assert "".join(lp.tokens) == whole.choices[0].text  # no special token in this completion
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(10)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 2 <= len(top) <= 3 and top[token] == value  # k most likely + the chosen token
        assert max(top.values()) == value  # greedy: the chosen token is the most likely
    streamed = _call(service, "completions", {**body, "stream": True})
    # the client builds stream chunks leniently (a chunk's finish_reason is null until the last)
    chunks = [construct_type(type_=openai.types.Completion, value=c) for c in streamed]
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [v for p in parts for v in p.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-4)
    assert [o for p in parts for o in p.text_offset] == lp.text_offset  # offsets continue across chunks
    plain = _call(service, "completions", COMPLETION)
    assert plain["choices"][0]["logprobs"] is None and plain["choices"][0]["text"] == whole.choices[0].text


def test_logprobs_zero_alternatives(service):
    out = openai.types.chat.ChatCompletion.model_validate(_call(service, "chat", {**CHAT, "max_tokens": 3, "logprobs": True}))
    assert [c.top_logprobs for c in out.choices[0].logprobs.content] == [[], [], []]
    assert _call(service, "chat", {**CHAT, "max_tokens": 3})["choices"][0]["logprobs"] is None


BAD = [
    ("chat", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {**CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("chat", {**CHAT, "top_logprobs": 2}, "top_logprobs"),  # without logprobs: true (as OpenAI)
    ("chat", {**CHAT, "logprobs": 1}, "logprobs"),  # a bool
    ("completions", {**COMPLETION, "logprobs": 6}, "logprobs"),
    ("completions", {**COMPLETION, "logprobs": True}, "logprobs"),  # an integer
    ("completions", {**COMPLETION, "logprobs": 1, "echo": True}, "echo"),  # prompt logprobs: not served
]


@pytest.mark.parametrize("route,body,param", BAD, ids=[f"{r}-{p}-{i}" for i, (r, _, p) in enumerate(BAD)])
def test_bad_logprob_values_are_400s_naming_the_field(service, route, body, param):
    with pytest.raises(ApiError) as err:
        _call(service, route, body)
    assert err.value.status == 400 and err.value.param == param and err.value.message.startswith(param)


def test_token_texts_are_exact_bytes(service):
    texts, tok = service.token_texts, service.backend.tokenizer
    assert texts.byte_level  # SmolLM2: byte-level BPE
    ids = tok("naïve café — 東京")["input_ids"]
    assert b"".join(bytes(texts(i)[1]) for i in ids).decode() == "naïve café — 東京"
    assert texts(tok.eos_token_id)[0] == tok.eos_token


def test_sglang_request_body_and_stream_logprobs():
    """SGLang's /generate asks output logprobs with `return_logprob` + `top_logprobs_num`, and streams
    cumulative `output_token_logprobs` [(logprob, id, text)] / `output_top_logprobs` in `meta_info`."""
    body = request_body(GenRequest(prompt_ids=[1, 2], settings=GenerationConfig(max_new_tokens=3), logprobs=2))
    assert body["return_logprob"] is True and body["top_logprobs_num"] == 2 and body["logprob_start_len"] == -1
    assert "return_logprob" not in request_body(GenRequest(prompt_ids=[1]))
    meta = {
        "finish_reason": None,
        "output_token_logprobs": [(-0.1, 5, None), (-0.2, 6, None), (-0.3, 7, None)],
        "output_top_logprobs": [[(-0.1, 5, None), (-2.0, 9, None)], [(-0.2, 6, None), (-1.5, 3, None)], None],
    }
    chunk, sent = chunk_from_event({"output_ids": [5, 6, 7], "meta_info": meta}, 1)
    assert chunk.token_ids == [6, 7] and sent == 3
    assert [(e.token_id, e.logprob, e.top) for e in chunk.logprobs] == [(6, -0.2, ((6, -0.2), (3, -1.5))), (7, -0.3, ())]
    plain, _ = chunk_from_event({"output_ids": [5], "meta_info": {"finish_reason": None}}, 0)
    assert plain.logprobs is None
    assert server_env({}, gpu_ids=["0"])["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1"  # raw, as the engine backend
