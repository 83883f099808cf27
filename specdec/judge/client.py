"""Talking to an engine through the standard OpenAI completions API (and its Prometheus /metrics)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import re
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence

import httpx


@functools.cache
def ssl_context() -> ssl.SSLContext:
    """One context for every client: building one costs ~70 ms (it loads the CA bundle)."""
    return ssl.create_default_context()


def http_get(url: str, timeout_s: float = 10.0) -> httpx.Response:
    return httpx.get(url, timeout=timeout_s, verify=ssl_context())


class RequestError(Exception):
    """A request to an engine failed: connection, HTTP status, timeout or an answer without what we need."""

    def __init__(self, message: str, dropped: bool = False):
        super().__init__(message)
        self.dropped = dropped  # the connection failed or closed: the engine may be going down


class NoLogprobs(RequestError):
    """The engine answered a scoring request without prompt log-probs (it ignores echo / logprobs)."""


@dataclasses.dataclass
class Reply:
    text: str
    completion_tokens: int
    finish_reason: str | None
    tokens: list[str] | None = None  # per-token strings, when logprobs were asked for
    token_logprobs: list[float | None] | None = None
    top_logprobs: list[dict | None] | None = None
    text_offset: list[int] | None = None


def parse_reply(data: dict) -> Reply:
    try:
        choice = data["choices"][0]
        text = choice["text"]
    except (KeyError, IndexError, TypeError):
        raise RequestError(f"the answer has no choices[0].text: {str(data)[:200]}") from None
    usage = data.get("usage") or {}
    if "completion_tokens" not in usage:
        raise RequestError("the answer has no usage.completion_tokens, so its tokens cannot be counted")
    logprobs = choice.get("logprobs") or {}
    return Reply(text, int(usage["completion_tokens"]), choice.get("finish_reason"), logprobs.get("tokens"),
                 logprobs.get("token_logprobs"), logprobs.get("top_logprobs"), logprobs.get("text_offset"))


class EngineApi:
    """One engine's base URL, model name and request timeout."""

    def __init__(self, base_url: str, model: str = "default", timeout_s: float = 300.0):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.timeout_s = timeout_s
        self.echo_max_tokens = 0  # becomes 1 for engines that refuse max_tokens=0 with echo

    def client(self) -> httpx.AsyncClient:
        """A client with one connection (one per worker: httpx's pool slows down with hundreds in one)."""
        return httpx.AsyncClient(base_url=self.base_url, verify=ssl_context(), limits=httpx.Limits(max_connections=1),
                                 timeout=httpx.Timeout(self.timeout_s, connect=min(self.timeout_s, 30.0)))

    async def post(self, client: httpx.AsyncClient, body: dict) -> tuple[int, dict | str]:
        try:
            resp = await asyncio.wait_for(client.post("/v1/completions", json={"model": self.model, **body}),
                                          self.timeout_s)
        except (asyncio.TimeoutError, httpx.TimeoutException):
            raise RequestError(f"no answer within the request timeout of {self.timeout_s:g} s") from None
        except httpx.HTTPError as exc:
            raise RequestError(f"{type(exc).__name__}: {exc or 'the connection failed'}", dropped=True) from None
        try:
            return resp.status_code, resp.json()
        except ValueError:
            return resp.status_code, resp.text

    async def complete(self, client: httpx.AsyncClient, body: dict) -> Reply:
        status, data = await self.post(client, body)
        if status != 200 or not isinstance(data, dict):
            raise RequestError(f"HTTP {status}: {str(data)[:300]}")
        return parse_reply(data)

    async def score(self, client: httpx.AsyncClient, text: str) -> Reply:
        """The text's own tokens with their log-probs (and top-1), through echo + logprobs."""
        body = {"prompt": text, "echo": True, "logprobs": 1, "temperature": 0.0}
        sent = self.echo_max_tokens  # read once: concurrent requests may have sent 0 before one learnt to send 1
        status, data = await self.post(client, {**body, "max_tokens": sent})
        if status == 400 and sent == 0:  # some engines want at least one new token
            self.echo_max_tokens = 1
            status, data = await self.post(client, {**body, "max_tokens": 1})
        if status != 200 or not isinstance(data, dict):
            raise RequestError(f"scoring with echo + logprobs: HTTP {status}: {str(data)[:300]}")
        reply = parse_reply(data)
        if reply.tokens is None or reply.token_logprobs is None:
            raise NoLogprobs("echo + logprobs returned no tokens / token_logprobs")
        return prompt_part(reply, len(text))


def prompt_part(reply: Reply, text_len: int) -> Reply:
    """Drop the tokens an engine generated after an echoed prompt (when it needed max_tokens >= 1)."""
    n = len(reply.tokens)
    if reply.text_offset is not None:
        n = sum(1 for off in reply.text_offset if off < text_len)
    elif reply.completion_tokens:
        n -= reply.completion_tokens
    cut = (lambda xs: None if xs is None else list(xs[:n]))
    return Reply(reply.text[:text_len], 0, reply.finish_reason, cut(reply.tokens), cut(reply.token_logprobs),
                 cut(reply.top_logprobs), cut(reply.text_offset))


async def run_batch(api: EngineApi, bodies: Sequence[dict], concurrency: int,
                    on_reply: Callable[[Reply], None] | None = None,
                    poll: Callable[[httpx.AsyncClient], Awaitable[None]] | None = None,
                    score: bool = False) -> tuple[list[Reply], float]:
    """Send every body with at most `concurrency` in flight; replies in order and the wall-clock seconds.

    With score=True each body is {"prompt": text} and is scored (echo) instead of completed.  `poll(client)`,
    if given, is awaited every 0.1 s while the batch runs (e.g. to sample KV-cache use from /metrics).
    """
    replies: list[Reply | None] = [None] * len(bodies)
    pending = iter(range(len(bodies)))

    async def worker():
        async with api.client() as client:
            for i in pending:  # one iterator shared by all workers: each index is taken once
                body = bodies[i]
                replies[i] = await (api.score(client, body["prompt"]) if score else api.complete(client, body))
                if on_reply is not None:
                    on_reply(replies[i])

    finished = asyncio.Event()

    async def poller():
        async with api.client() as client:
            while not finished.is_set():
                await poll(client)
                try:
                    await asyncio.wait_for(finished.wait(), 0.1)
                except asyncio.TimeoutError:
                    pass
            await poll(client)  # once more after the last reply: a short batch may end between polls

    start = time.perf_counter()
    tasks = [asyncio.create_task(worker()) for _ in range(max(1, min(concurrency, len(bodies))))]
    side = [asyncio.create_task(poller())] if poll is not None else []
    try:
        await asyncio.gather(*tasks)
        seconds = time.perf_counter() - start
        finished.set()
        await asyncio.gather(*side)
    finally:
        for task in tasks + side:
            task.cancel()
        await asyncio.gather(*tasks, *side, return_exceptions=True)
    return replies, seconds


METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {metric name: value summed over label sets}.

    Each labelled series is also kept under its own key, `name{labels}`.
    """
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = METRIC_LINE.match(line.strip())
        if match is None:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        name, labels = match.group(1), match.group(2)
        values[name] = values.get(name, 0.0) + value
        if labels:
            values[name + labels] = value
    return values


def find_metric(values: dict[str, float], patterns: Sequence[str]) -> float | None:
    """The value of the best metric whose name contains one of the patterns (earlier patterns first).

    Counters' `_created` / histograms' `_bucket` series never match; `_total` names are preferred, then the
    shortest name.  A pattern with a brace matches one labelled series (`peak_memory_bytes{kind="rss"}`).
    """
    for pattern in patterns:
        names = [n for n in values if all(part in n for part in pattern.split("{"))
                 and ("{" in n) == ("{" in pattern) and not n.endswith(("_created", "_bucket"))]
        if names:
            return values[min(names, key=lambda n: (not n.endswith("_total"), len(n)))]
    return None


ACCEPTED = ("accepted_tokens",)
DRAFTED = ("draft_tokens",)
VERIFY_STEPS = ("verify_steps", "num_drafts", "drafts_total")
# what an engine of this project also reports, where it has them: its steps and their seconds, and of those the
# steps outside its CUDA graphs (prefill and mixed steps: the costly ones)
ENGINE_STEPS = ("engine_steps",)
ENGINE_STEP_SECONDS = ("engine_step_seconds",)
EAGER_STEPS = ("engine_eager_steps",)
EAGER_STEP_SECONDS = ("engine_eager_step_seconds",)
STEP_COUNTERS = {"engine_steps": ENGINE_STEPS, "step_seconds": ENGINE_STEP_SECONDS, "eager_steps": EAGER_STEPS,
                 "eager_step_seconds": EAGER_STEP_SECONDS}
KV_USE = ("kv_cache_usage", "kv_usage", "cache_usage_perc", "kv_cache_utilization")
# an engine's own report of its memory, for engines the judge did not start: device memory first
ENGINE_MEMORY_BYTES = ('peak_memory_bytes{kind="device"', 'peak_memory_bytes{kind="rss"',
                       "process_resident_memory_bytes")


async def fetch_metrics(client: httpx.AsyncClient) -> dict[str, float] | None:
    """The client's engine's /metrics (None if it has none)."""
    try:
        resp = await client.get("/metrics", timeout=10.0)
    except httpx.HTTPError:
        return None
    return parse_metrics(resp.text) if resp.status_code == 200 else None


def fetch_metrics_sync(base_url: str) -> dict[str, float] | None:
    try:
        resp = http_get(f"{base_url}/metrics")
    except httpx.HTTPError:
        return None
    return parse_metrics(resp.text) if resp.status_code == 200 else None


def kv_use(values: dict[str, float] | None) -> float | None:
    """KV-cache use in [0, 1] (engines that report a percentage in [0, 100] are scaled)."""
    value = find_metric(values or {}, KV_USE)
    if value is None:
        return None
    return value / 100.0 if value > 1.0 else value
