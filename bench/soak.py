#!/usr/bin/env python3
"""Soak and fault run (issue 23): a speculating server under mixed valid, invalid and disconnecting clients,
its /draft drafter killed and restarted mid-run, then SIGTERM with requests in flight.

Everything runs on 127.0.0.1, in processes of its own: ``specdec draft serve DRAFTER`` and
``specdec serve MODEL --speculator remote --draft-url ...``.  The run is bounded in time (``--duration-s``
of mixed load, then bounded waits for idle, recovery and shutdown) and in count (``--max-requests``).

1. Warm-up: one reference reply per prompt and kind, one at a time (greedy completions and chats, and
   sampled completions with fixed seeds), then ``--warmup-s`` of the mix; the server's resident memory
   (RSS) is read after it.
2. Soak: ``--clients`` concurrent clients, each looping over a weighted mix of greedy completions and chats
   (streaming or not; the reply must equal the reference for the same prompt), sampled completions with a
   seed (compared with that seed's reference: counted, an invariant only with ``--strict-sampled``, since
   a seeded draw depends on how many drafts each step verified), valid requests with unknown fields
   (ignored: the reply must equal the reference), invalid requests (must get a 4xx with an OpenAI error
   body, never a 5xx), and clients that disconnect mid-stream or before a whole answer.  At
   ``--kill-at-s`` the drafter is killed (SIGKILL) and ``--outage-s`` later started again; requests
   during the outage must succeed (the engine decodes without drafts) with the same greedy replies.
3. After the soak: until the engine has answered a /draft call again (bounded), then until it is idle;
   KV-cache use, RSS and the ``specdec_remote_draft_*`` metrics are read.
4. SIGTERM with ``--clients`` requests in flight, and two more sent just after it: each must complete (with
   the reference reply) or get a clear error (an HTTP error, an error event, or a refused connection), never
   hang or end silently; the server must exit with status 0 (a graceful shutdown) within
   ``--term-timeout-s``.  Then the drafter gets a SIGTERM too and must exit with status 0.

Invariants (exit status 1 if any fails): no 5xx (seen by clients or counted on /metrics), no lost reply
(a valid request with neither a complete reply nor an error), no corrupted reply, every invalid request
answered 4xx, requests served during the outage, the drafter's outage seen and its recovery seen, KV use
back to 0 when idle (free prefix-cached blocks are not counted as used), RSS at the end within
``--rss-tolerance`` of its level after warm-up, no traceback in the server's log, clean SIGTERMs.

    python3 bench/soak.py --duration-s 600 --out bench/results/soak-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from specdec.parent_watch import child_env  # noqa: E402

HELDOUT_PROMPTS = REPO / "specdec" / "assets" / "heldout-prompts.jsonl"
GREEDY_KINDS = ("cmpl", "cmpl_stream", "chat", "chat_stream", "extra_fields")
VALID_KINDS = GREEDY_KINDS + ("sampled", "sampled_stream")
MIX = {  # kind -> weight
    "cmpl": 3, "cmpl_stream": 2, "chat": 2, "chat_stream": 2, "extra_fields": 1,
    "sampled": 1, "sampled_stream": 1, "invalid": 3, "disconnect_stream": 1, "disconnect_wait": 1,
}
SEEDS = (11, 12)
TERM_KINDS = ("cmpl_stream", "chat_stream", "cmpl", "chat")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------- requests


def invalid_requests(big_body_bytes: int) -> list[tuple[str, str, bytes | None, dict, int]]:
    """(name, method + path, raw body or None, JSON body, expected status) of requests that must be refused."""
    chat = "POST /v1/chat/completions"
    cmpl = "POST /v1/completions"
    user = [{"role": "user", "content": "x"}]
    return [
        ("bad json", cmpl, b"{not json", {}, 400),
        ("empty body", cmpl, b"", {}, 400),
        ("not an object", cmpl, b"[1, 2]", {}, 400),
        ("NaN", cmpl, b'{"prompt": "hi", "temperature": NaN}', {}, 400),
        ("lone surrogate", cmpl, b'{"prompt": "\\ud800"}', {}, 400),
        ("not utf-8", cmpl, b'{"prompt": "\xff\xfe"}', {}, 400),
        ("max_tokens a string", cmpl, None, {"prompt": "hi", "max_tokens": "5"}, 400),
        ("max_tokens negative", cmpl, None, {"prompt": "hi", "max_tokens": -1}, 400),
        ("max_tokens huge", cmpl, None, {"prompt": "hi", "max_tokens": 10 ** 12}, 400),
        ("temperature negative", cmpl, None, {"prompt": "hi", "temperature": -0.5}, 400),
        ("top_p out of range", cmpl, None, {"prompt": "hi", "top_p": 1.5}, 400),
        ("stream a string", cmpl, None, {"prompt": "hi", "stream": "yes"}, 400),
        ("logprobs too many", cmpl, None, {"prompt": "hi", "logprobs": 99}, 400),
        ("n zero", cmpl, None, {"prompt": "hi", "n": 0}, 400),
        ("seed too large", cmpl, None, {"prompt": "hi", "seed": 2 ** 70}, 400),
        ("token id out of range", cmpl, None, {"prompt": [10 ** 9]}, 400),
        ("token id a float", cmpl, None, {"prompt": [1.5]}, 400),
        ("no prompt", cmpl, None, {"max_tokens": 3}, 400),
        ("penalty", cmpl, None, {"prompt": "hi", "presence_penalty": 1.0}, 400),
        ("unknown model", cmpl, None, {"prompt": "hi", "model": "no-such-model"}, 404),
        ("no messages", chat, None, {"messages": []}, 400),
        ("messages a string", chat, None, {"messages": "hi"}, 400),
        ("unknown role", chat, None, {"messages": [{"role": "robot", "content": "x"}]}, 400),
        ("top_logprobs without logprobs", chat, None, {"messages": user, "top_logprobs": 2}, 400),
        ("text/plain", cmpl + " text/plain", b'{"prompt": "hi"}', {}, 415),
        ("body too large", cmpl, b'{"prompt": "' + b"x" * big_body_bytes + b'"}', {}, 413),
        ("unknown route", "POST /v1/nothing", None, {"prompt": "hi"}, 404),
        ("wrong method", "GET /v1/completions", None, {}, 405),
    ]


@dataclasses.dataclass
class Outcome:
    kind: str
    phase: str
    start: float  # seconds since the run's start
    end: float
    status: int | None  # HTTP status, None when no response came
    result: str  # ok | corrupted | sampled_drift | server_error | rejected | lost | refused | clear_error | ...
    detail: str = ""


@dataclasses.dataclass
class Reply:
    status: int | None  # None: no response
    text: str  # the reply's text, or the error's message
    finish: str | None
    ended: str  # complete | error (an HTTP error or an error event) | refused (no connection) | lost (else)


class Client:
    """The request kinds, each returning an Outcome; replies checked against the warm-up references."""

    def __init__(self, url: str, model: str, prompts: list[str], args: argparse.Namespace, t0: float):
        self.url = url
        self.model = model
        self.prompts = prompts
        self.args = args
        self.t0 = t0
        self.references: dict[tuple, tuple[str, str]] = {}  # (kind group, prompt, seed) -> (text, finish)
        self.invalid = invalid_requests(args.big_body_mib << 20)

    def now(self) -> float:
        return time.monotonic() - self.t0

    # ----------------------------------------------------------------- bodies

    def body(self, kind: str, i: int, seed: int | None = None, max_tokens: int | None = None) -> tuple[str, dict]:
        """(path, JSON body) of a valid request of `kind` for prompt i."""
        stream = kind.endswith("_stream")
        n = max_tokens or self.args.max_tokens
        if kind.startswith("chat"):
            content = self.prompts[i][: max(8, self.args.prompt_chars // 2)]
            return "/v1/chat/completions", {"model": self.model, "messages": [{"role": "user", "content": content}],
                                            "max_tokens": n, "temperature": 0, "stream": stream}
        body = {"model": self.model, "prompt": self.prompts[i], "max_tokens": n, "stream": stream}
        if kind.startswith("sampled"):
            body.update(temperature=self.args.temperature, top_p=0.95, seed=seed)
        else:
            body["temperature"] = 0
        if kind == "extra_fields":  # fields the server does not know are ignored, as OpenAI's API does
            body.update(no_such_field=1, metadata={"soak": True}, user="soak")
        return "/v1/completions", body

    @staticmethod
    def ref_key(kind: str, i: int, seed: int | None) -> tuple:
        group = "chat" if kind.startswith("chat") else "sampled" if kind.startswith("sampled") else "cmpl"
        return group, i, seed if group == "sampled" else None

    # ----------------------------------------------------------------- sending

    async def send(self, http: httpx.AsyncClient, path: str, body: dict, chat: bool, timeout: float | None = None,
                   on_event=None) -> Reply:
        """One request, its reply read whole; on_event() is called on a stream's first event."""
        try:
            if body.get("stream"):
                return await self._stream(http, path, body, chat, timeout or self.args.request_timeout_s, on_event)
            r = await http.post(self.url + path, json=body, timeout=timeout or self.args.request_timeout_s)
            if r.status_code != 200:
                return Reply(r.status_code, _error_message(r.content), None, "error")
            choice = r.json()["choices"][0]
            return Reply(200, choice["message"]["content"] if chat else choice["text"], choice["finish_reason"],
                         "complete")
        except httpx.ConnectError as exc:
            return Reply(None, f"{type(exc).__name__}: {exc}", None, "refused")
        except (httpx.HTTPError, json.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
            return Reply(None, f"{type(exc).__name__}: {exc}", None, "lost")

    async def _stream(self, http: httpx.AsyncClient, path: str, body: dict, chat: bool, timeout: float,
                      on_event) -> Reply:
        """A streamed reply: complete only with a finish reason and the closing [DONE]."""
        async with http.stream("POST", self.url + path, json=body, timeout=timeout) as r:
            if r.status_code != 200:
                return Reply(r.status_code, _error_message(await r.aread()), None, "error")
            parts, finish = [], None
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if on_event is not None:
                    on_event()
                    on_event = None
                if line == "data: [DONE]":
                    return Reply(200, "".join(parts), finish, "complete" if finish else "lost")
                event = json.loads(line[6:])
                if "error" in event:
                    return Reply(200, str(event["error"].get("message") or ""), None, "error")
                for choice in event["choices"]:
                    parts.append((choice.get("delta") or {}).get("content") or "" if chat else choice["text"])
                    finish = choice.get("finish_reason") or finish
            return Reply(200, "".join(parts), finish, "lost")  # the stream ended without [DONE]

    async def valid(self, http: httpx.AsyncClient, kind: str, phase: str, rng: random.Random) -> Outcome:
        i = rng.randrange(len(self.prompts))
        seed = rng.choice(SEEDS) if kind.startswith("sampled") else None
        path, body = self.body(kind, i, seed)
        start = self.now()
        reply = await self.send(http, path, body, kind.startswith("chat"))
        return Outcome(kind, phase, start, self.now(), reply.status, *self.judge(kind, i, seed, reply))

    def judge(self, kind: str, i: int, seed: int | None, reply: Reply) -> tuple[str, str]:
        """(result, detail) of a valid request's reply."""
        if reply.ended in ("lost", "refused"):
            return reply.ended, reply.text
        if reply.ended == "error":
            server = reply.status is None or reply.status >= 500 or reply.status == 200  # 200: an error event
            return ("server_error" if server else "rejected"), f"{reply.status}: {reply.text}"[:300]
        reference = self.references.get(self.ref_key(kind, i, seed))
        if reference is None or reference == (reply.text, reply.finish):
            return "ok", ""
        drift = "sampled_drift" if kind.startswith("sampled") else "corrupted"
        return drift, (f"prompt {i} seed {seed}: {reply.text!r} / {reply.finish} against "
                       f"{reference[0]!r} / {reference[1]}")[:400]

    async def bad(self, http: httpx.AsyncClient, phase: str, rng: random.Random) -> Outcome:
        """An invalid request: it must get a 4xx with an OpenAI error body (405 may come without one)."""
        name, route, raw, body, expected = rng.choice(self.invalid)
        method, path, *ctype = route.split(" ")
        headers = {"content-type": ctype[0] if ctype else "application/json"}
        content = raw if raw is not None else (json.dumps(body).encode() if method == "POST" else None)
        start = self.now()
        try:
            r = await http.request(method, self.url + path, content=content, headers=headers,
                                   timeout=self.args.request_timeout_s)
        except httpx.ConnectError as exc:
            return Outcome("invalid", phase, start, self.now(), None, "refused", f"{name}: {exc}")
        except httpx.HTTPError as exc:
            return Outcome("invalid", phase, start, self.now(), None, "lost", f"{name}: {type(exc).__name__}: {exc}")
        status = r.status_code
        if status >= 500:
            result = "server_error"
        elif not 400 <= status < 500:
            result = "invalid_accepted"
        elif status == 405 or _error_message(r.content, strict=True) is not None:
            result = "ok" if status == expected else "ok_other_4xx"
        else:
            result = "bad_error_body"
        return Outcome("invalid", phase, start, self.now(), status, result, f"{name}: {r.text[:200]}")

    async def disconnect(self, http: httpx.AsyncClient, kind: str, phase: str, rng: random.Random) -> Outcome:
        """A long greedy request the client leaves: mid-stream after a few events, or before a whole answer."""
        i = rng.randrange(len(self.prompts))
        path, body = self.body("cmpl", i, max_tokens=self.args.long_max_tokens)
        body["ignore_eos"] = True
        start = self.now()

        def outcome(status: int | None, result: str, detail: str = "") -> Outcome:
            return Outcome(kind, phase, start, self.now(), status, result, detail)

        try:
            if kind == "disconnect_stream":
                body["stream"] = True
                leave_after = rng.randint(1, 4)
                async with http.stream("POST", self.url + path, json=body, timeout=self.args.request_timeout_s) as r:
                    if r.status_code != 200:
                        return outcome(r.status_code, "server_error" if r.status_code >= 500 else "rejected")
                    events = 0
                    async for line in r.aiter_lines():
                        events += line.startswith("data: ")
                        if events >= leave_after:
                            break  # leaving the block closes the connection mid-stream
                return outcome(200, "ok", f"left after {events} events")
            r = await http.post(self.url + path, json=body, timeout=rng.uniform(0.2, 1.0))
            if r.status_code >= 500:
                return outcome(r.status_code, "server_error")
            return outcome(r.status_code, "ok", "answered before the client left")
        except httpx.TimeoutException:
            return outcome(None, "ok", "left before the answer")
        except httpx.ConnectError as exc:
            return outcome(None, "refused", str(exc))
        except httpx.HTTPError as exc:
            return outcome(None, "lost", f"{type(exc).__name__}: {exc}")

    async def one(self, http: httpx.AsyncClient, kind: str, phase: str, rng: random.Random) -> Outcome:
        if kind == "invalid":
            return await self.bad(http, phase, rng)
        if kind.startswith("disconnect"):
            return await self.disconnect(http, kind, phase, rng)
        return await self.valid(http, kind, phase, rng)

    # ----------------------------------------------------------------- phases

    async def make_references(self) -> dict:
        """One reply per (prompt, kind group, seed), one request at a time; each sampled one asked twice, to
        count whether a seeded draw repeats even without concurrency."""
        repeats = Counter()
        async with httpx.AsyncClient() as http:
            for i in range(len(self.prompts)):
                for kind, seed in [("cmpl", None), ("chat", None)] + [("sampled", s) for s in SEEDS]:
                    path, body = self.body(kind, i, seed)
                    got = []
                    for _ in range(2 if kind == "sampled" else 1):
                        reply = await self.send(http, path, body, kind == "chat")
                        if reply.ended != "complete":
                            raise RuntimeError(f"warm-up reference {kind} {i} failed: {reply.status} {reply.text}")
                        got.append((reply.text, reply.finish))
                    self.references[self.ref_key(kind, i, seed)] = got[0]
                    if len(got) > 1:
                        repeats["sampled_repeat_equal" if got[0] == got[1] else "sampled_repeat_differs"] += 1
        return dict(repeats)

    async def mix(self, phase: str, seconds: float, clients: int, max_requests: int, seed: int) -> list[Outcome]:
        """`clients` workers sending the weighted MIX back to back for `seconds` (or max_requests in all)."""
        deadline = time.monotonic() + seconds
        outcomes: list[Outcome] = []
        kinds, weights = list(MIX), list(MIX.values())

        async def worker(w: int) -> None:
            rng = random.Random(seed * 1000 + w)
            async with httpx.AsyncClient(limits=httpx.Limits(max_connections=4)) as http:
                while time.monotonic() < deadline and len(outcomes) < max_requests:
                    outcomes.append(await self.one(http, rng.choices(kinds, weights)[0], phase, rng))

        await asyncio.gather(*(worker(w) for w in range(clients)))
        return outcomes


def _error_message(content: bytes, strict: bool = False) -> str | None:
    """The message of an OpenAI error body; with strict, None when the body is not one."""
    try:
        error = json.loads(content)["error"]
        if isinstance(error, dict) and isinstance(error.get("message"), str) and error["message"]:
            return error["message"]
    except (ValueError, KeyError, TypeError):
        pass
    return None if strict else content[:200].decode("utf-8", "replace")


# ---------------------------------------------------------------------------------------------- processes


class Servers:
    """The drafter and the speculating server, as child processes on loopback running this checkout's code;
    logs in `workdir`."""

    def __init__(self, args: argparse.Namespace, workdir: Path):
        self.args = args
        self.workdir = workdir
        self.draft_port, self.port = free_port(), free_port()
        self.draft_url = f"http://127.0.0.1:{self.draft_port}"
        self.url = f"http://127.0.0.1:{self.port}"
        self.drafter: subprocess.Popen | None = None
        self.server: subprocess.Popen | None = None
        self.drafter_starts = 0
        path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
        self.env = {**child_env(), "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}

    def _spawn(self, argv: list[str], log_name: str) -> subprocess.Popen:
        with open(self.workdir / log_name, "ab") as log:
            return subprocess.Popen([sys.executable, "-m", "specdec.cli", *argv], cwd=REPO, env=self.env,
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)

    def start_drafter(self) -> None:
        self.drafter_starts += 1
        self.drafter = self._spawn(["draft", "serve", self.args.drafter, "--host", "127.0.0.1",
                                    "--port", str(self.draft_port), "--device", "cpu", *self.args.drafter_args.split()],
                                   "drafter.log")

    def start_server(self) -> None:
        self.server = self._spawn(["serve", self.args.model, "--host", "127.0.0.1", "--port", str(self.port),
                                   "--device", "cpu", "--speculator", "remote", "--draft-url", self.draft_url,
                                   "--log-level", "warning", *self.args.server_args.split()], "server.log")

    async def wait_healthy(self, url: str, process: subprocess.Popen, timeout_s: float) -> float:
        """Seconds until url/health answers 200; raises if the process exits first or the timeout passes."""
        start = time.monotonic()
        async with httpx.AsyncClient() as http:
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"{url} exited with status {process.returncode} before it was healthy "
                                       f"(logs in {self.workdir})")
                try:
                    if (await http.get(f"{url}/health", timeout=2.0)).status_code == 200:
                        return time.monotonic() - start
                except httpx.HTTPError:
                    pass
                if time.monotonic() - start > timeout_s:
                    raise RuntimeError(f"{url} was not healthy within {timeout_s} s (logs in {self.workdir})")
                await asyncio.sleep(0.2)

    def kill_drafter(self) -> None:
        self.drafter.send_signal(signal.SIGKILL)
        self.drafter.wait(30)

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.server.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS in /proc/PID/status")

    def cleanup(self) -> None:
        for process in (self.server, self.drafter):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGKILL)
                process.wait(30)


async def terminate(process: subprocess.Popen, timeout_s: float) -> tuple[int | None, float | None]:
    """SIGTERM, then (exit status, seconds to exit); (None, None) if it is still running after timeout_s."""
    start = time.monotonic()
    process.send_signal(signal.SIGTERM)
    try:
        rc = await asyncio.get_running_loop().run_in_executor(None, process.wait, timeout_s)
    except subprocess.TimeoutExpired:
        return None, None
    return rc, time.monotonic() - start


# ---------------------------------------------------------------------------------------------- metrics


async def read_metrics(url: str) -> dict[str, float]:
    """{'name{label=value,...}': value} of the server's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    async with httpx.AsyncClient() as http:
        text = (await http.get(f"{url}/metrics", timeout=10.0)).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def remote_metrics(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k.startswith("specdec_remote_draft_")}


def server_5xx(metrics: dict[str, float]) -> int:
    return int(sum(v for k, v in metrics.items() if k.startswith("specdec_requests_total{") and ",status=5" in k))


async def wait_idle(url: str, timeout_s: float) -> tuple[dict[str, float], float]:
    """/metrics once nothing runs or waits and no KV block is in use (or at the timeout); seconds waited."""
    start = time.monotonic()
    while True:
        m = await read_metrics(url)
        idle = (m.get("specdec_num_requests_running") == 0 and m.get("specdec_num_requests_waiting") == 0
                and m.get("specdec_kv_cache_usage") == 0)
        if idle or time.monotonic() - start > timeout_s:
            return m, time.monotonic() - start
        await asyncio.sleep(0.25)


# ---------------------------------------------------------------------------------------------- phases


async def drafter_fault(servers: Servers, client: Client, events: list[dict], args: argparse.Namespace,
                        soak_start: float) -> dict:
    """Kill the drafter at --kill-at-s into the soak, start it again --outage-s later."""
    info: dict = {}
    await asyncio.sleep(max(0.0, soak_start + args.kill_at_s - time.monotonic()))
    info["metrics_before_kill"] = remote_metrics(await read_metrics(servers.url))
    servers.kill_drafter()
    info["killed_at_s"] = round(client.now(), 2)
    events.append({"t": info["killed_at_s"], "event": "drafter SIGKILL", "rc": servers.drafter.returncode})
    await asyncio.sleep(args.outage_s)
    info["metrics_in_outage"] = remote_metrics(await read_metrics(servers.url))
    servers.start_drafter()
    events.append({"t": round(client.now(), 2), "event": "drafter restarting"})
    info["restart_s"] = round(await servers.wait_healthy(servers.draft_url, servers.drafter, args.startup_timeout_s), 2)
    info["restarted_at_s"] = round(client.now(), 2)
    events.append({"t": info["restarted_at_s"], "event": "drafter healthy again"})
    return info


async def wait_recovered(servers: Servers, client: Client, before: float,
                         timeout_s: float) -> tuple[bool, float, list[Outcome]]:
    """Greedy requests, one at a time, until /metrics counts a recovery of the drafter (bounded): (recovered,
    seconds waited, the requests' outcomes)."""
    start = time.monotonic()
    rng = random.Random(7)
    extra: list[Outcome] = []
    async with httpx.AsyncClient() as http:
        while True:
            m = await read_metrics(servers.url)
            if m.get("specdec_remote_draft_recoveries_total", 0) > before:
                return True, time.monotonic() - start, extra
            if time.monotonic() - start > timeout_s:
                return False, time.monotonic() - start, extra
            extra.append(await client.valid(http, "cmpl", "recovery", rng))


async def term_request(client: Client, kind: str, phase: str, rng: random.Random, timeout_s: float,
                       on_event=None) -> Outcome:
    """A greedy request around the SIGTERM: a complete reply (checked) or a clear error, never silence."""
    i = rng.randrange(len(client.prompts))
    path, body = client.body(kind, i)
    start = client.now()
    async with httpx.AsyncClient() as http:
        reply = await client.send(http, path, body, kind.startswith("chat"), timeout_s, on_event)
    if reply.ended in ("error", "refused"):
        clear = reply.ended == "refused" or reply.status != 200 or bool(reply.text)
        result, detail = ("clear_error" if clear else "lost"), f"{reply.status}: {reply.text}"[:300]
    else:
        result, detail = client.judge(kind, i, None, reply)
    return Outcome(kind, phase, start, client.now(), reply.status, result, detail)


async def sigterm_phase(servers: Servers, client: Client, args: argparse.Namespace, events: list[dict]) -> dict:
    """SIGTERM with --clients greedy requests in flight (every stream past its first event), two more requests
    0.3 s after it; then the server's exit status, waited for up to --term-timeout-s."""
    rng = random.Random(99)
    kinds = (list(TERM_KINDS) * args.clients)[:max(1, args.clients)]
    streams = sum(k.endswith("_stream") for k in kinds)
    all_streaming, first_events = asyncio.Event(), []

    def on_event() -> None:
        first_events.append(1)
        if len(first_events) >= streams:
            all_streaming.set()

    tasks = [asyncio.ensure_future(term_request(client, k, "sigterm", rng, args.term_timeout_s, on_event))
             for k in kinds]
    try:
        await asyncio.wait_for(all_streaming.wait(), 30)
    except asyncio.TimeoutError:
        pass
    in_flight = sum(not t.done() for t in tasks)
    exit_wait = asyncio.ensure_future(terminate(servers.server, args.term_timeout_s))
    events.append({"t": round(client.now(), 2), "event": f"server SIGTERM with {in_flight} requests in flight"})
    await asyncio.sleep(0.3)
    late = [asyncio.ensure_future(term_request(client, "cmpl", "after_sigterm", rng, args.term_timeout_s))
            for _ in range(2)]
    done, pending = await asyncio.wait(tasks + late, timeout=args.term_timeout_s)
    for t in pending:
        t.cancel()
    rc, exit_s = await exit_wait
    events.append({"t": round(client.now(), 2), "event": f"server exited with status {rc}"})
    outcomes = [t.result() for t in tasks if t in done]
    return {"in_flight_at_sigterm": in_flight, "results": dict(Counter(o.result for o in outcomes)),
            "hung": sum(t in pending for t in tasks),
            "after_sigterm": dict(Counter(t.result().result for t in late if t in done)),
            "details": [dataclasses.asdict(o) for o in outcomes if o.result != "ok"][:10],
            "server_exit_status": rc, "server_exit_s": None if exit_s is None else round(exit_s, 2)}


# ---------------------------------------------------------------------------------------------- the run


async def run_phases(servers: Servers, args: argparse.Namespace) -> dict:
    """Start-up, references, warm-up, soak with the drafter fault, recovery, idle, SIGTERM: what was seen."""
    prompts = [json.loads(line)["prompt"][: args.prompt_chars]
               for line in HELDOUT_PROMPTS.read_text().splitlines()[: args.prompts]]
    t0 = time.monotonic()
    f: dict = {"events": []}
    events = f["events"]
    servers.start_drafter()
    servers.start_server()
    f["startup_s"] = {"drafter": round(await servers.wait_healthy(servers.draft_url, servers.drafter,
                                                                  args.startup_timeout_s), 2),
                      "server": round(await servers.wait_healthy(servers.url, servers.server,
                                                                 args.startup_timeout_s), 2)}
    async with httpx.AsyncClient() as http:
        model = (await http.get(f"{servers.url}/v1/models")).json()["data"][0]["id"]
    client = Client(servers.url, model, prompts, args, t0)
    events.append({"t": round(client.now(), 2), "event": "both servers healthy"})

    ref_start = time.monotonic()
    f["sampled_repeats"] = await client.make_references()
    f["references"] = {"count": len(client.references), "seconds": round(time.monotonic() - ref_start, 2)}
    outcomes = await client.mix("warmup", args.warmup_s, args.clients, args.max_requests, seed=1)
    f["warm_metrics"], _ = await wait_idle(servers.url, args.idle_timeout_s)
    f["rss_warm"] = servers.rss_bytes()
    events.append({"t": round(client.now(), 2), "event": "warm-up done"})

    soak_start = time.monotonic()
    fault = asyncio.ensure_future(drafter_fault(servers, client, events, args, soak_start))
    outcomes += await client.mix("soak", args.duration_s, args.clients, args.max_requests, seed=2)
    f["soak_s"] = round(time.monotonic() - soak_start, 1)
    events.append({"t": round(client.now(), 2), "event": "soak mix done"})
    f["fault"] = await fault  # the restart may outlast a short soak
    before = f["warm_metrics"].get("specdec_remote_draft_recoveries_total", 0)
    f["recovered"], f["recovery_wait_s"], extra = await wait_recovered(servers, client, before,
                                                                       args.recovery_timeout_s)
    f["outcomes"] = outcomes + extra
    f["idle_metrics"], f["idle_wait_s"] = await wait_idle(servers.url, args.idle_timeout_s)
    f["rss_end"] = servers.rss_bytes()
    events.append({"t": round(client.now(), 2), "event": "idle; metrics and RSS read"})

    f["sigterm"] = await sigterm_phase(servers, client, args, events)
    f["drafter_exit_status"], _ = await terminate(servers.drafter, 30)
    events.append({"t": round(client.now(), 2), "event": f"drafter stopped (status {f['drafter_exit_status']})"})
    return f


def outage_outcomes(f: dict) -> list[Outcome]:
    """Valid requests sent and answered while the drafter was down."""
    down, up = f["fault"]["killed_at_s"], f["fault"]["restarted_at_s"]
    return [o for o in f["outcomes"] if o.kind in VALID_KINDS and o.start >= down and o.end <= up]


def check(f: dict, args: argparse.Namespace, log_text: str) -> dict[str, bool]:
    """The run's invariants, by name."""
    results = Counter(o.result for o in f["outcomes"])
    idle, term = f["idle_metrics"], f["sigterm"]
    failures = "specdec_remote_draft_failures_total"  # by the end: the outage's calls may come late (adaptive k)
    during = outage_outcomes(f)
    return {
        "no_5xx_seen_by_clients": results["server_error"] == 0,
        "no_5xx_on_metrics": server_5xx(idle) == 0,
        "no_lost_replies": results["lost"] == 0 and results["refused"] == 0,
        "no_corrupted_replies": results["corrupted"] == 0 and (not args.strict_sampled or results["sampled_drift"] == 0),
        "valid_requests_not_rejected": results["rejected"] == 0,
        "invalid_requests_answered_4xx": results["invalid_accepted"] == 0 and results["bad_error_body"] == 0,
        "served_during_drafter_outage": bool(during) and all(o.result in ("ok", "sampled_drift") for o in during),
        "drafter_outage_seen": idle.get(failures, 0) > f["fault"]["metrics_before_kill"].get(failures, 0),
        "drafter_recovery_seen": f["recovered"],
        "kv_idle_after": idle.get("specdec_kv_cache_usage") == 0 and idle.get("specdec_num_requests_running") == 0,
        "rss_within_tolerance": abs(f["rss_end"] / f["rss_warm"] - 1) <= args.rss_tolerance,
        "no_traceback_in_server_log": "Traceback" not in log_text,
        "sigterm_no_hang": term["hung"] == 0 and term["server_exit_status"] is not None,
        "sigterm_clean_exit": term["server_exit_status"] == 0,
        "sigterm_in_flight_complete_or_clear_error": set(term["results"]) <= {"ok", "clear_error"},
        "after_sigterm_complete_or_clear_error": set(term["after_sigterm"]) <= {"ok", "clear_error"},
        "drafter_clean_exit": f["drafter_exit_status"] == 0,
    }


def make_record(f: dict, args: argparse.Namespace, workdir: Path) -> dict:
    from bench.common import environment

    import torch

    log_text = (workdir / "server.log").read_text(errors="replace")
    invariants = check(f, args, log_text)
    outcomes, idle, fault = f["outcomes"], f["idle_metrics"], f["fault"]
    by_kind: dict[str, Counter] = defaultdict(Counter)
    for o in outcomes:
        by_kind[o.kind][o.result] += 1
    valid = [o for o in outcomes if o.kind in VALID_KINDS]
    sampled = Counter(o.result for o in outcomes if o.kind.startswith("sampled"))
    return {
        **environment(torch.device("cpu")),
        "metric": "soak", "device": "cpu", "model": args.model, "drafter": args.drafter, "speculator": "remote",
        "settings": vars(args), "workdir": str(workdir),
        "passed": all(invariants.values()),
        "invariants": invariants,
        "startup_s": f["startup_s"], "references": f["references"], "sampled_repeats": f["sampled_repeats"],
        "soak_s": f["soak_s"],
        "served": {"total": len(outcomes), "valid": len(valid),
                   "valid_ok": sum(o.result in ("ok", "sampled_drift") for o in valid),
                   "greedy_checked_equal": sum(o.kind in GREEDY_KINDS and o.result == "ok" for o in outcomes),
                   "by_phase": dict(Counter(o.phase for o in outcomes))},
        "results": dict(Counter(o.result for o in outcomes)),
        "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
        "sampled": {"equal_to_reference": sampled["ok"], "differ_from_reference": sampled["sampled_drift"],
                    "strict": args.strict_sampled},
        "failures": [dataclasses.asdict(o) for o in outcomes
                     if o.result not in ("ok", "ok_other_4xx", "sampled_drift")][:20],
        "sampled_drift_examples": [o.detail for o in outcomes if o.result == "sampled_drift"][:3],
        "other_4xx": [o.detail for o in outcomes if o.result == "ok_other_4xx"][:5],
        "server_5xx_on_metrics": server_5xx(idle),
        "drafter_fault": {"killed_at_s": fault["killed_at_s"], "restarted_at_s": fault["restarted_at_s"],
                          "restart_s": fault["restart_s"], "valid_requests_during_outage": len(outage_outcomes(f)),
                          "recovered": f["recovered"], "recovery_wait_s": round(f["recovery_wait_s"], 2),
                          "exit_status": f["drafter_exit_status"]},
        "remote_draft_metrics": {"before_kill": fault["metrics_before_kill"], "in_outage": fault["metrics_in_outage"],
                                 "after": remote_metrics(idle)},
        "kv_cache_usage": {"after_warmup": f["warm_metrics"].get("specdec_kv_cache_usage"),
                           "end": idle.get("specdec_kv_cache_usage")},
        "idle_wait_s": round(f["idle_wait_s"], 2),
        "request_aborts": idle.get("specdec_request_aborts_total"),
        "engine_step_errors": idle.get("specdec_engine_step_errors_total"),
        "spec": {k: idle.get(f"specdec_{k}_total") for k in
                 ("spec_draft_tokens", "spec_accepted_tokens", "spec_verify_steps", "engine_steps")},
        "requests_on_metrics": {k.split("{", 1)[1].rstrip("}"): int(v) for k, v in idle.items()
                                if k.startswith("specdec_requests_total{")},
        "rss_bytes": {"after_warmup": f["rss_warm"], "end": f["rss_end"],
                      "change": round(f["rss_end"] / f["rss_warm"] - 1, 4),
                      "peak_on_metrics": idle.get("specdec_peak_memory_bytes{kind=rss}")},
        "sigterm": f["sigterm"],
        "events": f["events"],
    }


async def soak(args: argparse.Namespace) -> dict:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="specdec-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    servers = Servers(args, workdir)
    try:
        facts = await run_phases(servers, args)
    finally:
        servers.cleanup()
    return make_record(facts, args, workdir)


def print_summary(r: dict) -> None:
    s, d, rss = r["served"], r["drafter_fault"], r["rss_bytes"]
    print(f"soak {r['soak_s']} s: {s['total']} requests ({s['valid']} valid, {s['valid_ok']} answered, "
          f"{s['greedy_checked_equal']} greedy replies equal to the reference); results {r['results']}")
    print(f"sampled with a seed: {r['sampled']['equal_to_reference']} equal to the warm-up reply, "
          f"{r['sampled']['differ_from_reference']} differ")
    print(f"drafter killed at {d['killed_at_s']} s, healthy again at {d['restarted_at_s']} s; "
          f"{d['valid_requests_during_outage']} valid requests during the outage; recovered: {d['recovered']}")
    print(f"idle: KV use {r['kv_cache_usage']['end']}, 5xx on /metrics {r['server_5xx_on_metrics']}, "
          f"aborts {r['request_aborts']}; RSS {rss['after_warmup'] / 2**20:.0f} MiB after warm-up, "
          f"{rss['end'] / 2**20:.0f} MiB at the end ({rss['change']:+.1%})")
    t = r["sigterm"]
    print(f"SIGTERM with {t['in_flight_at_sigterm']} in flight: {t['results']}, hung {t['hung']}, after it "
          f"{t['after_sigterm']}; exit status {t['server_exit_status']} in {t['server_exit_s']} s; "
          f"drafter exit status {d['exit_status']}")
    for name, ok in r["invariants"].items():
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")
    print("PASSED" if r["passed"] else "FAILED", f"(logs in {r['workdir']})")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration-s", type=float, default=600.0, help="seconds of mixed load (600)")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients (8)")
    p.add_argument("--max-requests", type=int, default=100_000, help="most requests of the warm-up + soak mix")
    p.add_argument("--warmup-s", type=float, default=None, help="seconds of the mix before RSS is read "
                   "(default: 10%% of --duration-s, at most 60)")
    p.add_argument("--kill-at-s", type=float, default=None, help="drafter SIGKILL, seconds into the soak (30%%)")
    p.add_argument("--outage-s", type=float, default=None, help="seconds before the drafter is started again (20%%)")
    p.add_argument("--model", default="ref-target")
    p.add_argument("--drafter", default="ref-draft")
    p.add_argument("--server-args", default="", help="more `specdec serve` flags")
    p.add_argument("--drafter-args", default="", help="more `specdec draft serve` flags")
    p.add_argument("--prompts", type=int, default=12, help="distinct prompts (bundled held-out set)")
    p.add_argument("--prompt-chars", type=int, default=400, help="prompt length in characters")
    p.add_argument("--max-tokens", type=int, default=24, help="max_tokens of checked requests")
    p.add_argument("--long-max-tokens", type=int, default=256, help="max_tokens of requests the client leaves")
    p.add_argument("--temperature", type=float, default=0.8, help="sampled requests' temperature")
    p.add_argument("--strict-sampled", action="store_true",
                   help="a sampled reply that differs from its seed's warm-up reply fails the run")
    p.add_argument("--big-body-mib", type=int, default=5, help="size of the too-large body (MiB)")
    p.add_argument("--rss-tolerance", type=float, default=0.10)
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    p.add_argument("--idle-timeout-s", type=float, default=30.0)
    p.add_argument("--recovery-timeout-s", type=float, default=60.0)
    p.add_argument("--term-timeout-s", type=float, default=60.0)
    p.add_argument("--workdir", default=None, help="where the servers' logs go (default: a new temp directory)")
    p.add_argument("--out", default=None, help="JSON record")
    args = p.parse_args(argv)
    if args.warmup_s is None:
        args.warmup_s = min(60.0, 0.1 * args.duration_s)
    if args.kill_at_s is None:
        args.kill_at_s = 0.3 * args.duration_s
    if args.outage_s is None:
        args.outage_s = 0.2 * args.duration_s
    return args


def run(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    record = asyncio.run(soak(args))
    print_summary(record)
    if args.out:
        from bench.common import write_json

        write_json(args.out, record)
    return record


def main(argv: list[str] | None = None) -> int:
    return 0 if run(argv)["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
