"""The OpenAI endpoints: prompts -> engine requests -> JSON responses or server-sent events."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse

from specdec.engine.request import TokenLogprobs
from specdec.errors import InvalidRequestError
from specdec.llm import encode_prompt
from specdec.sampling import SamplingParams
from specdec.server.choices import fit_to_context, sample_params
from specdec.server.engine_core import EngineInfo
from specdec.server.engine_loop import EngineLoop, Group
from specdec.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body

DISCONNECT_POLL_S = 1.0


class IncrementalText:
    """Text released while tokens stream in: never a half character, never part of a stop string.

    Each update decodes a short window, not the whole output (which would make a long stream quadratic):
    the tokens since the last settled point plus a few before it for context, and keeps the part of the
    window's text beyond what the context alone decodes to.  Example: settled text "def f", context
    tokens ["def", " f"], new token "(x" -> decode(["def", " f", "(x"]) = "def f(x", minus
    decode(["def", " f"]) = "def f" -> "(x".  A window ending in U+FFFD (an incomplete UTF-8 sequence)
    waits for more tokens."""

    CONTEXT = 4  # settled tokens decoded again in front of the new ones

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str]):
        self.decode = decode
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # settled text of ids[:self.settled]
        self.settled = 0
        self.sent = 0

    def _settle(self) -> None:
        start = max(0, self.settled - self.CONTEXT)
        context = self.decode(self.ids[start:self.settled]) if start < self.settled else ""
        window = self.decode(self.ids[start:])
        if window.endswith("\ufffd") or len(window) < len(context):
            return
        self.text += window[len(context):]
        self.settled = len(self.ids)

    def update(self, ids: list[int], finished: bool, final_text: str | None) -> str:
        self.ids.extend(ids)
        if finished:
            text = final_text if final_text is not None else self.decode(self.ids)
            end = len(text)
        elif ids:
            self._settle()
            text = self.text
            end = len(text) - self.hold
        else:
            return ""
        if end <= self.sent:
            return ""
        new, self.sent = text[self.sent:end], end
        return new


@dataclasses.dataclass
class Choice:
    """One choice (one sample of one prompt) as the HTTP side sees it."""

    index: int
    prompt_ids: list[int]
    detok: IncrementalText
    params: SamplingParams
    sample: int = 0  # which of the prompt's n samples (usage counts the prompt with sample 0 only)
    echo_text: str = ""
    prompt_logprobs: list[TokenLogprobs] | None = None  # the first entry's logprob and top are None
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    text_offset: int = 0  # where the next token's text starts (completions log-probs)


class Serving:
    def __init__(self, engine_loop: EngineLoop, metrics, model_name: str):
        self.engine_loop = engine_loop
        self.metrics = metrics
        self.model_name = model_name
        self._token_text: dict[int, str] = {}

    @property
    def info(self) -> EngineInfo:  # known once the engine is started (before the app serves)
        return self.engine_loop.info

    @property
    def tokenizer(self):
        return self.engine_loop.tokenizer

    # ------------------------------------------------------------------ endpoints

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "specdec", "max_model_len": self.info.max_model_len}]}

    async def completions(self, body: CompletionRequest, http: HTTPRequest):
        self._check_model(body.model)
        body.check_supported()
        raw_prompts = body.prompt_list()
        prompts = [encode_prompt(self.tokenizer, p) for p in raw_prompts]
        max_tokens = body.max_tokens
        score_only = max_tokens == 0 and body.echo
        if max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens must be at least 1 (0 only with echo=true, to score the prompt)",
                           param="max_tokens")
        params = body.sampling_params(1 if score_only else 16 if max_tokens is None else max_tokens, body.logprobs)
        given = "max_tokens" if body.max_tokens_given and not score_only else None
        choices = self._choices(prompts, params, body.choices_per_prompt, given)
        if body.echo:
            await self._echo(choices, raw_prompts, body.choices_per_prompt, body.logprobs)
        group = await self._start(choices, generate=not score_only)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        events = self._events(group, choices, http, poll_disconnect=not body.stream)
        with_logprobs = body.logprobs is not None

        def chunk(c: Choice, text: str, entries: list[TokenLogprobs]) -> dict[str, Any]:
            logprobs = self._completion_logprobs(c, entries) if with_logprobs else None
            choice = {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason}
            return {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                    "choices": [choice]}

        if body.stream:
            async def stream():
                if body.echo:
                    for c in choices:
                        yield chunk(c, c.echo_text, c.prompt_logprobs or [])
                async for c, text, entries in events:
                    if text or entries or c.finish_reason:
                        yield chunk(c, text, entries)
            return self._sse(stream(), rid, created, "text_completion", group, choices, body.include_usage)
        async for _ in events:
            pass
        out = [chunk(c, c.echo_text + c.text, (c.prompt_logprobs or []) + c.logprobs)["choices"][0]
               for c in choices]
        return self._json(rid, created, "text_completion", out, choices)

    async def chat(self, body: ChatCompletionRequest, http: HTTPRequest):
        self._check_model(body.model)
        body.check_supported()
        if self.tokenizer is None:
            raise APIError(400, "this model directory has no tokenizer.json: use /v1/completions with token ids")
        text = self.tokenizer.apply_chat_template([m.to_template() for m in body.messages])
        ids = self.tokenizer.encode(text, add_special_tokens=False)  # the template writes any BOS itself
        max_tokens = body.requested_max_tokens
        given = None if max_tokens is None else (
            "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens")
        params = body.sampling_params(self.info.max_model_len if max_tokens is None else max_tokens,
                                      body.logprobs_n)
        choices = self._choices([ids], params, body.choices_per_prompt, given)
        group = await self._start(choices, generate=True)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        events = self._events(group, choices, http, poll_disconnect=not body.stream)

        def logprobs(entries: list[TokenLogprobs]) -> dict[str, Any] | None:
            return {"content": [self._chat_logprob(e) for e in entries]} if body.logprobs else None

        if body.stream:
            def chunk(c: Choice, delta: dict[str, Any], entries: list[TokenLogprobs]) -> dict[str, Any]:
                choice = {"index": c.index, "delta": delta, "logprobs": logprobs(entries),
                          "finish_reason": c.finish_reason}
                return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                        "choices": [choice]}

            async def stream():
                for c in choices:
                    yield chunk(c, {"role": "assistant", "content": ""}, [])
                async for c, text, entries in events:
                    if text or entries or c.finish_reason:
                        yield chunk(c, {"content": text} if text else {}, entries)
            return self._sse(stream(), rid, created, "chat.completion.chunk", group, choices, body.include_usage)
        async for _ in events:
            pass
        out = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": logprobs(c.logprobs), "finish_reason": c.finish_reason} for c in choices]
        return self._json(rid, created, "chat.completion", out, choices)

    # ------------------------------------------------------------------ requests -> engine

    def _check_model(self, model: str | None) -> None:
        if model and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist: this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def _choices(self, prompts: list[list[int]], params: SamplingParams, n: int,
                 max_tokens_param: str | None) -> list[Choice]:
        """n choices per prompt, choice p * n + i being sample i of prompt p; all checked before any work is
        queued.  max_tokens_param names the field when the client chose max_tokens (it must then fit)."""
        choices = []
        for p, ids in enumerate(prompts):
            self.info.limits.validate(ids, params)
            name = f"prompt {p} (of {len(prompts)})" if len(prompts) > 1 else "prompt"
            fitted = fit_to_context(params, len(ids), self.info.max_model_len, max_tokens_param, name)
            for i, sample in enumerate(sample_params(fitted, n)):
                choices.append(Choice(len(choices), ids, IncrementalText(self._decode, sample.stop), sample, i))
        return choices

    async def _echo(self, choices: list[Choice], raw_prompts: list, n: int, logprobs: int | None) -> None:
        """The prompt in front of each choice's text; its log-probs scored once per prompt."""
        for p, raw in enumerate(raw_prompts):
            first = choices[p * n]
            text = raw if isinstance(raw, str) else self._decode(first.prompt_ids)
            scored = None if logprobs is None else await self.engine_loop.prompt_logprobs(first.prompt_ids, logprobs)
            for c in choices[p * n:(p + 1) * n]:
                c.echo_text, c.prompt_logprobs = text, scored

    async def _start(self, choices: list[Choice], generate: bool) -> Group | None:
        group = None
        if generate:
            group = await self.engine_loop.generate([(c.prompt_ids, c.params) for c in choices])
        else:  # echo with max_tokens=0: the prompt is the whole answer
            for c in choices:
                c.finish_reason = "length"
        self.metrics.prompt_tokens.inc(_prompt_tokens(choices))
        return group

    async def _events(self, group: Group | None, choices: list[Choice], http: HTTPRequest,
                      poll_disconnect: bool) -> AsyncIterator[tuple[Choice, str, list[TokenLogprobs]]]:
        """Apply the engine's events to the choices; yield (choice, new text, new log-probs) per event.

        Leaving early (error, client gone, cancelled) aborts the group's unfinished requests.
        """
        if group is None:
            for c in choices:
                yield c, "", []
            return
        left = len(choices)
        getter: asyncio.Future | None = None
        loop = asyncio.get_running_loop()
        next_check = loop.time() + DISCONNECT_POLL_S
        try:
            while left:
                getter = getter or asyncio.ensure_future(group.events.get())
                done, _ = await asyncio.wait({getter}, timeout=DISCONNECT_POLL_S)
                if loop.time() >= next_check:  # a streaming response learns of a disconnect from Starlette
                    next_check = loop.time() + DISCONNECT_POLL_S
                    if not self.engine_loop.alive:
                        raise APIError(503, "the engine stopped", type="server_error")
                    if poll_disconnect and await http.is_disconnected():
                        return
                if not done:
                    continue
                delta, getter = getter.result(), None
                if delta.error:
                    raise APIError(500, delta.error, type="server_error")
                c = choices[delta.index]
                c.token_ids += delta.token_ids
                c.logprobs += delta.logprobs or []
                c.finish_reason = delta.finish_reason
                left -= delta.finish_reason is not None
                self.metrics.generation_tokens.inc(len(delta.token_ids))
                text = c.detok.update(delta.token_ids, delta.finish_reason is not None, delta.text)
                c.text += text
                yield c, text, delta.logprobs or []
        finally:
            if getter is not None:
                getter.cancel()
            if left:
                self.engine_loop.abort(group)

    # ------------------------------------------------------------------ responses

    def _json(self, rid: str, created: int, obj: str, out: list[dict], choices: list[Choice]) -> JSONResponse:
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": self.model_name,
                             "choices": out, "usage": _usage(choices)})

    def _sse(self, chunks: AsyncIterator[dict], rid: str, created: int, obj: str, group: Group | None,
             choices: list[Choice], include_usage: bool) -> StreamingResponse:
        async def body():
            try:
                async for chunk in chunks:
                    yield _sse_line(chunk)
                if include_usage:
                    yield _sse_line({"id": rid, "object": obj, "created": created, "model": self.model_name,
                                     "choices": [], "usage": _usage(choices)})
            except APIError as exc:
                yield _sse_line(exc.body())
            except InvalidRequestError as exc:
                yield _sse_line(error_body(str(exc)))
            yield "data: [DONE]\n\n"

        def on_close() -> None:  # the client left before the body even started: still free the requests
            if group is not None and any(c.finish_reason is None for c in choices):
                self.engine_loop.abort(group)

        return _EventStream(body(), on_close, media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def _completion_logprobs(self, c: Choice, entries: list[TokenLogprobs]) -> dict[str, Any]:
        tokens, values, tops, offsets = [], [], [], []
        for e in entries:
            token = self._token(e.token_id)
            tokens.append(token)
            values.append(_finite(e.logprob))
            tops.append(None if e.top is None else {self._token(t): _finite(v) for t, v in e.top})
            offsets.append(c.text_offset)
            c.text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _chat_logprob(self, e: TokenLogprobs) -> dict[str, Any]:
        token = self._token(e.token_id)
        return {"token": token, "logprob": _finite(e.logprob), "bytes": list(token.encode()),
                "top_logprobs": [{"token": (s := self._token(t)), "logprob": _finite(v), "bytes": list(s.encode())}
                                 for t, v in e.top]}

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def _token(self, token_id: int) -> str:
        """One token's text, as log-prob entries show it."""
        text = self._token_text.get(token_id)
        if text is None:
            text = (self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer is not None
                    else f"token_id:{token_id}")
            self._token_text[token_id] = text
        return text


class _EventStream(StreamingResponse):
    """A StreamingResponse that calls on_close however it ends, even when its body never started."""

    def __init__(self, content, on_close: Callable[[], None], **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def _prompt_tokens(choices: list[Choice]) -> int:
    """Each prompt counted once, however many samples it has."""
    return sum(len(c.prompt_ids) for c in choices if c.sample == 0)


def _usage(choices: list[Choice]) -> dict[str, int]:
    prompt = _prompt_tokens(choices)
    completion = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finite(x: float | None) -> float | None:
    """JSON has no infinities: a -inf log-prob is reported as a very large negative number."""
    if x is None or math.isfinite(x):
        return x
    return -9999.0 if x < 0 else 9999.0


def _sse_line(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
