"""OpenAI request bodies (strict: unknown fields and wrong types are 400s naming the field) and
OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deploy.serve.logprobs import MAX_CHAT_TOP_LOGPROBS, MAX_COMPLETION_LOGPROBS
from drelay_model.errors import DRelayError


class ApiError(DRelayError):
    """An HTTP error with an OpenAI-style body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(_Body):
    include_usage: bool = True


class _Sampling(_Body):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None  # ranges: GenerationConfig's checks (deploy/serve/service.py)
    top_k: int | None = None  # SGLang/vLLM extension; 0 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)  # one choice per request
    user: str | None = None
    return_spec_tokens_details: bool = False  # SGLang's switch for the `sglext` object

    def stop_list(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ApiError(400, "stop: at most 4 non-empty strings", param="stop")
        return stops


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def logprob_alternatives(self) -> int | None:
        """k alternatives per token when log-probabilities were asked (`logprobs: true`), else None."""
        if not self.logprobs:
            if self.top_logprobs is not None:
                raise ApiError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
            return None
        k = self.top_logprobs or 0
        if not 0 <= k <= MAX_CHAT_TOP_LOGPROBS:
            raise ApiError(400, f"top_logprobs: must be in 0..{MAX_CHAT_TOP_LOGPROBS}, got {k}", param="top_logprobs")
        return k


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    echo: bool = False
    logprobs: int | None = None

    def logprob_alternatives(self) -> int | None:
        """k alternatives per token when `logprobs: k` was asked, else None."""
        k = self.logprobs
        if k is None:
            return None
        if not 0 <= k <= MAX_COMPLETION_LOGPROBS:
            raise ApiError(400, f"logprobs: must be in 0..{MAX_COMPLETION_LOGPROBS}, got {k}", param="logprobs")
        if self.echo:
            raise ApiError(400, "echo: the prompt's log-probabilities (echo with logprobs) are not served", param="echo")
        return k


def parse_body(raw: bytes, model: type[_Body]):
    """Validate a JSON body; the first problem becomes a 400 naming its field."""
    try:
        return model.model_validate_json(raw or b"")
    except ValidationError as exc:
        err = exc.errors()[0]
        if err["type"] == "json_invalid" or not raw:
            raise ApiError(400, "malformed JSON body: " + err["msg"]) from None
        where = ".".join(str(p) for p in err["loc"]) or None
        msg = "unrecognized request argument" if err["type"] == "extra_forbidden" else err["msg"]
        raise ApiError(400, f"{where}: {msg}", param=where) from None
