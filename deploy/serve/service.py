"""The OpenAI routes' logic, independent of Ray: validate → render the prompt → submit to the backend →
answer in one JSON body or as server-sent events. Every answer carries `usage`; requests that set
`return_spec_tokens_details: true` also get SGLang's `sglext` object (+ the method name); requests that
ask `logprobs` get each token's log-probability (`deploy/serve/logprobs.py`), in every streamed chunk."""

from __future__ import annotations

import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator

from deploy.serve.backends.base import Backend, GenChunk, GenRequest, Overloaded, SpecStats
from deploy.serve.config import ServeConfig
from deploy.serve.detokenize import IncrementalText, stop_predicate
from deploy.serve.logprobs import LogprobRenderer, TokenTexts
from deploy.serve.protocol import ApiError, ChatRequest, CompletionRequest, parse_body
from drelay_model.decoding import GenerationConfig, SettingsError
from drelay_model.errors import DRelayError
from pipelines.common.chat import render_chat


def bearer_matches(authorization: str | None, api_key: str) -> bool:
    """Whether an `Authorization` header carries `api_key` as a Bearer credential. The scheme is
    case-insensitive and may be followed by several spaces (RFC 7235 §2.1); the key is compared in
    constant time."""
    scheme, _, credential = (authorization or "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(credential.strip().encode(), api_key.encode())


class Service:
    def __init__(self, cfg: ServeConfig, backend: Backend, api_key: str | None = None, metrics=None) -> None:
        self.cfg, self.backend, self.api_key, self.metrics = cfg, backend, api_key, metrics
        self.token_texts = TokenTexts(backend.tokenizer)  # logprobs' token strings, cached

    # ---- small routes --------------------------------------------------------------------------
    def check_auth(self, authorization: str | None) -> None:
        if self.api_key and not bearer_matches(authorization, self.api_key):
            raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')", code="invalid_api_key")

    def models(self) -> dict:
        return {
            "object": "list",
            "data": [{"id": self.cfg.model_id, "object": "model", "created": 0, "owned_by": "drelay", "method": self.cfg.method}],
        }

    # ---- generation ----------------------------------------------------------------------------
    async def generate(self, route: str, raw: bytes) -> dict | AsyncIterator[str]:
        """route 'chat' or 'completions'; a dict (one body) or an SSE line iterator (stream)."""
        body = parse_body(raw, ChatRequest if route == "chat" else CompletionRequest)
        if body.model != self.cfg.model_id:
            raise ApiError(
                404, f"model '{body.model}' does not exist (served: {self.cfg.model_id})", param="model", code="model_not_found"
            )
        prompt_ids, field = self._prompt(route, body)
        stops = body.stop_list()
        k = body.logprob_alternatives()  # None: not asked
        settings = self._settings(body, stop_predicate(self.backend.tokenizer, stops))
        lim = self.cfg.limits
        if len(prompt_ids) > lim.max_prompt_tokens:
            raise ApiError(
                400,
                f"{field}: {len(prompt_ids)} prompt tokens, over the limit of {lim.max_prompt_tokens}",
                param=field,
                code="context_length_exceeded",
            )
        request = GenRequest(prompt_ids=prompt_ids, settings=settings, logprobs=k)
        try:
            chunks = self.backend.submit(request)
        except Overloaded as exc:
            raise ApiError(
                503, str(exc), type="server_error", code="overloaded", headers={"Retry-After": str(lim.retry_after_s)}
            ) from None
        except DRelayError as exc:
            raise ApiError(400, f"{field}: {exc}", param=field, code="context_length_exceeded") from None
        call = _Call(route, body, len(prompt_ids), IncrementalText(self.backend.tokenizer, stops), self)
        call.logprobs = None if k is None else LogprobRenderer(self.token_texts, route, k)
        return call.stream(chunks) if body.stream else await call.collect(chunks)

    def _prompt(self, route: str, body) -> tuple[list[int], str]:
        tok = self.backend.tokenizer
        if route == "chat":
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            return render_chat(tok, messages), "messages"
        if isinstance(body.prompt, str):
            if not body.prompt:
                raise ApiError(400, "prompt: must not be empty", param="prompt")
            return list(tok(body.prompt)["input_ids"]), "prompt"
        if not body.prompt:
            raise ApiError(400, "prompt: must not be empty", param="prompt")
        return list(body.prompt), "prompt"

    def _settings(self, body, stop) -> GenerationConfig:
        """The request's decode settings: the API's defaults, this server's caps (max_tokens, temperature),
        then `GenerationConfig`'s own checks, whose field becomes the 400's param."""
        lim = self.cfg.limits
        n = getattr(body, "max_completion_tokens", None)
        n = body.max_tokens if n is None else n
        n = lim.default_max_tokens if n is None else n
        if n > lim.max_tokens:
            raise ApiError(400, f"max_tokens: must be ≤ {lim.max_tokens} on this server, got {n}", param="max_tokens")
        temperature = 1.0 if body.temperature is None else body.temperature
        if temperature > lim.max_temperature:
            raise ApiError(
                400, f"temperature: must be ≤ {lim.max_temperature} on this server, got {temperature}", param="temperature"
            )
        given = {"top_p": body.top_p, "top_k": body.top_k, "seed": body.seed}
        try:
            return GenerationConfig(
                max_new_tokens=n, temperature=temperature, stop=stop, **{k: v for k, v in given.items() if v is not None}
            )
        except SettingsError as exc:
            param = _PARAMS.get(exc.field, exc.field)
            raise ApiError(400, f"{param}: {exc.detail}", param=param) from None


_PARAMS = {"max_new_tokens": "max_tokens"}  # GenerationConfig field → API parameter, where they differ


class _Call:
    """One generation request being answered."""

    def __init__(self, route: str, body, prompt_tokens: int, text: IncrementalText, service: Service) -> None:
        self.route, self.body, self.prompt_tokens, self.text, self.service = route, body, prompt_tokens, text, service
        self.id = ("chatcmpl-" if route == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.t0, self.t_first, self.n_tokens = time.perf_counter(), None, 0
        self.logprobs: LogprobRenderer | None = None  # set when the request asked for log-probabilities

    def _track(self, chunk: GenChunk) -> None:
        if self.t_first is None:
            self.t_first = time.perf_counter()
        self.n_tokens += len(chunk.token_ids)

    def _done(self, spec: SpecStats | None) -> tuple[dict, dict | None]:
        """usage and (when asked) sglext; records the request's metrics."""
        completion = spec.completion_tokens if spec else self.n_tokens
        usage = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }
        metrics = self.service.metrics
        if metrics is not None:
            metrics.finished(
                self.route,
                latency=time.perf_counter() - self.t0,
                ttft=(self.t_first or self.t0) - self.t0,
                prompt_tokens=self.prompt_tokens,
                tokens=completion,
                spec=spec,
            )
        sglext = None
        if self.body.return_spec_tokens_details and spec is not None:
            sglext = spec.sglext(self.service.cfg.method)
        return usage, sglext

    def _choice(self, text: str, finish: str | None, *, delta: bool, logprobs: dict | None = None) -> dict:
        if self.route == "completions":
            return {"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}
        if delta:
            return {"index": 0, "delta": {"content": text} if text else {}, "logprobs": logprobs, "finish_reason": finish}
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs, "finish_reason": finish}

    def _object(self, stream: bool) -> str:
        if self.route == "chat":
            return "chat.completion.chunk" if stream else "chat.completion"
        return "text_completion"

    def _envelope(self, stream: bool, **fields) -> dict:
        return {"id": self.id, "object": self._object(stream), "created": self.created, "model": self.body.model, **fields}

    async def collect(self, chunks: AsyncIterator[GenChunk]) -> dict:
        last, entries = None, []
        async for chunk in chunks:
            self._track(chunk)
            self.text.push(chunk.token_ids, final=chunk.finish_reason is not None)
            entries += chunk.logprobs or []
            last = chunk
        usage, sglext = self._done(last.spec)
        logprobs = self.logprobs.render(entries) if self.logprobs else None
        choice = self._choice(self.text.full(), last.finish_reason, delta=False, logprobs=logprobs)
        out = self._envelope(False, choices=[choice], usage=usage)
        if sglext is not None:
            out["sglext"] = sglext
        return out

    async def stream(self, chunks: AsyncIterator[GenChunk]) -> AsyncIterator[str]:
        def sse(obj: dict) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        try:
            if self.route == "chat":
                role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                yield sse(self._envelope(True, choices=[role]))
            async for chunk in chunks:
                self._track(chunk)
                delta = self.text.push(chunk.token_ids, final=chunk.finish_reason is not None)
                logprobs = self.logprobs.render(chunk.logprobs or []) if self.logprobs else None  # this chunk's tokens
                if delta or chunk.finish_reason or (chunk.logprobs and logprobs):
                    choice = self._choice(delta, chunk.finish_reason, delta=True, logprobs=logprobs)
                    yield sse(self._envelope(True, choices=[choice]))
                if chunk.finish_reason:
                    usage, sglext = self._done(chunk.spec)
                    tail = self._envelope(True, choices=[], usage=usage)
                    if sglext is not None:
                        tail["sglext"] = sglext
                    yield sse(tail)
        except Exception as exc:  # the engine failed mid-stream: tell the client in-band
            yield sse(ApiError(500, f"generation failed: {exc}", type="server_error").body())
        yield "data: [DONE]\n\n"
