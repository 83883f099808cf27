"""OpenAI request bodies (pydantic) and the OpenAI error shape.

Ranges (temperature, top_p, max_tokens, ...) are checked by `SamplingParams`, the one place that
knows them; the models here only check types.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictInt

from specdec.errors import InvalidRequestError
from specdec.sampling import SamplingParams

TokenIds = list[StrictInt]


class APIError(Exception):
    """An error answered as OpenAI's {"error": {...}} with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM): 0 or -1 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None  # extension (vLLM)
    ignore_eos: bool = False  # extension (vLLM)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted and ignored

    def check_supported(self) -> None:
        if self.n not in (None, 1):
            raise APIError(400, f"n must be 1, got {self.n}: this server returns one choice per prompt", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported: leave it out or set it to 0", param=name)
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")

    def sampling_params(self, max_tokens: Any, logprobs: int | None) -> SamplingParams:
        """SamplingParams for this request; raises InvalidRequestError naming a bad value."""
        top_k = self.top_k or 0
        return SamplingParams(max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p, top_k=0 if top_k == -1 else top_k,
                              seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
                              ignore_eos=self.ignore_eos, logprobs=logprobs)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: str | TokenIds | list[str] | list[TokenIds]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of not in (None, 1):
            raise APIError(400, f"best_of must be 1, got {self.best_of}", param="best_of")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")

    def prompt_list(self) -> list[str | list[int]]:
        """The prompts: one string or token list is one prompt, a list of them is several."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise InvalidRequestError("prompt is empty: give at least one token")
        return list(p)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def to_template(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise APIError(400, "only text content parts are supported", param="messages")
            content = "".join(part.text or "" for part in content)
        out = {"role": self.role, "content": content or ""}
        if self.name:
            out["name"] = self.name
        return out


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if not self.messages:
            raise APIError(400, "messages is empty: give at least one message", param="messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")

    @property
    def logprobs_n(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
