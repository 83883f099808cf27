"""OpenAI request bodies (pydantic) and the OpenAI error shape.

Every field is strict: a boolean must be true or false, an integer an integer, a number a number
(``"stream": "yes"`` or ``"max_tokens": "5"`` is a 400, as in OpenAI's API).  Each field's
description says what is allowed; error messages quote it (`specdec.server.request_body`).
Ranges of sampling values (temperature, top_p, max_tokens, ...) are checked by `SamplingParams`, the
one place that knows them; the models here check types and the ranges only the server knows.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specdec.errors import InvalidRequestError
from specdec.sampling import SamplingParams

MAX_N = 16  # choices per prompt (n); documented in docs/USAGE.md
MAX_TOP_LOGPROBS = 20  # as SamplingParams.logprobs
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1  # OpenAI's range for seed
STRICT = ConfigDict(extra="ignore", strict=True)


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
    model_config = STRICT

    include_usage: bool = Field(False, description="true or false")


class _SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = STRICT

    model: str | None = Field(None, description="the served model's name (a string)")
    temperature: float | None = Field(None, description="a number in [0, 100] (0 = greedy)")
    top_p: float | None = Field(None, description="a number in (0, 1]")
    top_k: int | None = Field(None, description="an integer: 0 or -1 = off, else the top-k tokens")  # vLLM
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX,
                             description=f"an integer in [{INT64_MIN}, {INT64_MAX}]")
    stop: str | list[str] | None = Field(None, description="a string or a list of strings")
    stop_token_ids: list[int] | None = Field(None, description="a list of token ids (integers)")  # vLLM
    ignore_eos: bool = Field(False, description="true or false")  # vLLM
    stream: bool | None = Field(False, description="true or false")
    stream_options: StreamOptions | None = Field(None, description='an object such as {"include_usage": true}')
    n: int | None = Field(1, ge=1, le=MAX_N, description=f"an integer in [1, {MAX_N}] (choices per prompt)")
    presence_penalty: float | None = Field(None, description="a number (only 0 is supported)")
    frequency_penalty: float | None = Field(None, description="a number (only 0 is supported)")
    logit_bias: dict[str, float] | None = Field(None, description="an object of token id -> number (unsupported)")
    user: str | None = Field(None, description="a string")  # accepted and ignored

    def check_supported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported: leave it out or set it to 0", param=name)
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")

    @property
    def choices_per_prompt(self) -> int:
        return 1 if self.n is None else self.n

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
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="a string, a list of token ids (integers), or a list of strings or of token-id lists")
    max_tokens: int | None = Field(16, description="a positive integer (0 only with echo=true)")
    logprobs: int | None = Field(None, description=f"an integer in [0, {MAX_TOP_LOGPROBS}]")
    echo: bool = Field(False, description="true or false")
    best_of: int | None = Field(None, description="1 (other values are not supported)")
    suffix: str | None = Field(None, description="a string (unsupported)")

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of not in (None, 1):
            raise APIError(400, f"best_of must be 1, got {self.best_of}: ask for several samples with n",
                           param="best_of")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")

    @property
    def max_tokens_given(self) -> bool:
        """True when the client chose max_tokens (a value too large for the context is then an error)."""
        return "max_tokens" in self.model_fields_set and self.max_tokens is not None

    def prompt_list(self) -> list[str | list[int]]:
        """The prompts: one string or token list is one prompt, a list of them is several."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise InvalidRequestError("prompt is empty: give at least one token")
        return list(p)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: str = Field(description='a string ("text")')
    text: str | None = Field(None, description="a string")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="one of 'system', 'developer', 'user', 'assistant', 'tool'")
    content: str | list[ContentPart] | None = Field(None, description="a string or a list of text parts")
    name: str | None = Field(None, description="a string")

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
    messages: list[ChatMessage] = Field(description='a list of messages such as {"role": "user", "content": "Hi"}')
    max_tokens: int | None = Field(None, description="a positive integer")
    max_completion_tokens: int | None = Field(None, description="a positive integer")
    logprobs: bool | None = Field(False, description="true or false")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                     description=f"an integer in [0, {MAX_TOP_LOGPROBS}] (with logprobs=true)")

    def check_supported(self) -> None:
        super().check_supported()
        if not self.messages:
            raise APIError(400, "messages is empty: give at least one message", param="messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens, else max_tokens; None when the client left both out."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def logprobs_n(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
