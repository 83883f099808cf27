"""The HTTP side's handle on the engine: an asyncio API over the engine loop (`engine_core.EngineCore`).

Handlers call `generate`, `abort` and `prompt_logprobs`; each becomes a command message for the engine
loop, which runs either on a thread of this process (`InThread`, given an LLM) or in an engine process
of its own (`engine_process.EngineProcess`, given an EngineSpec).  The loop's `Outputs` (one per engine
step) come back to `_deliver` on a thread (the engine thread, or the thread reading the engine process's
pipe), which hands each one to the event loop with a single `call_soon_threadsafe`; there each
group's `Delta`s go to the asyncio queue of the HTTP request that owns it.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import Callable
from typing import Any

from specdec.engine.request import TokenLogprobs
from specdec.server.engine_core import Abort, Add, Delta, EngineCore, EngineInfo, Job, Outputs, Score, peak_rss_bytes

__all__ = ["Delta", "EngineLoop", "EngineUnavailable", "Group", "InThread"]

STOPPED = "the engine stopped"


class EngineUnavailable(RuntimeError):
    """The engine is not running (not started yet, stopped, or dead)."""


class Group:
    """The engine requests of one HTTP request and the asyncio queue their events go to."""

    def __init__(self, id: int, jobs: int):
        self.id = id
        self.events: asyncio.Queue[Delta] = asyncio.Queue()
        self.unfinished = set(range(jobs))  # job indices without their last event yet

    def put(self, delta: Delta) -> None:
        self.events.put_nowait(delta)
        if delta.finish_reason is not None:
            self.unfinished.discard(delta.index)


class InThread:
    """The engine loop on a background thread of this process, over an LLM built here."""

    remote = False  # the engine's memory is this process's

    def __init__(self, llm):
        self.llm = llm
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self, deliver: Callable[[Outputs | None], None]) -> tuple[EngineInfo, Any]:
        core = EngineCore(self.llm)

        def run():
            try:
                core.run(self.commands, deliver)
            finally:
                deliver(None)

        self._thread = threading.Thread(target=run, name="specdec-engine", daemon=True)
        self._thread.start()
        return core.info, self.llm.tokenizer

    def send(self, command) -> None:
        self.commands.put(command)

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float) -> None:
        self.commands.put(None)
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)


class EngineLoop:
    def __init__(self, transport):
        self.transport = transport
        self.info: EngineInfo | None = None  # set by start()
        self.tokenizer = None  # the model's tokenizer (None: the model directory has none), set by start()
        self.snapshot: dict[str, Any] = {}  # the engine's latest Engine.metrics()
        self.step_errors = 0
        self.aborted = 0
        self._peak_memory: dict[str, int] = {}
        self._groups: dict[int, Group] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running = False
        self._stopping = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start the engine loop and wait until it is ready (raises what kept it from starting)."""
        self._loop = asyncio.get_running_loop()
        self.info, self.tokenizer = await asyncio.to_thread(self.transport.start, self._deliver)
        self._running = True

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine loop (any thread); requests still waiting get "the engine stopped"."""
        self._stopping = True
        self.transport.stop(timeout)

    @property
    def alive(self) -> bool:
        return self._running and not self._stopping and self.transport.alive()

    def peak_memory(self) -> dict[str, int]:
        """{"device": bytes, "rss": bytes}: the engine process's peaks, plus this process's RSS when apart."""
        memory = dict(self._peak_memory)
        if self.transport.remote:
            memory["rss"] = memory.get("rss", 0) + peak_rss_bytes()
        return memory

    # ------------------------------------------------------------------ the asyncio side's API

    async def generate(self, jobs: list[Job]) -> Group:
        """Queue one request per (prompt, params) job (all or none); their events arrive on the group's queue,
        each with its job's position as `Delta.index`."""
        group = Group(next(self._ids), len(jobs))
        self._groups[group.id] = group
        try:
            await self._call(lambda call: Add(call, group.id, jobs))
        except asyncio.CancelledError:  # the client left while the requests were being queued
            self.abort(group)
            raise
        except BaseException:
            self._groups.pop(group.id, None)
            raise
        return group

    def abort(self, group: Group) -> None:
        """Stop a group's unfinished requests and free their KV blocks (fire and forget)."""
        if self._groups.pop(group.id, None) is not None and self.alive:
            try:
                self.transport.send(Abort(group.id))
            except OSError:  # the engine process is gone: nothing left to stop
                pass

    async def prompt_logprobs(self, token_ids: list[int], top_n: int) -> list[TokenLogprobs]:
        """Per prompt token: log p(token | tokens before it) and the top_n alternatives.

        The first token has no context: its entry's logprob and top are None.
        """
        first = TokenLogprobs(token_ids[0], None, None)  # type: ignore[arg-type]
        if len(token_ids) < 2:
            return [first]
        return [first] + await self._call(lambda call: Score(call, token_ids, top_n))

    async def _call(self, command: Callable[[int], Any]) -> Any:
        """Send command(call id) and wait for its answer."""
        if not self.alive:
            raise EngineUnavailable("the engine is not running")
        call = next(self._ids)
        future = self._loop.create_future()
        self._calls[call] = future
        try:
            self._send(command(call))
            return await future
        finally:
            self._calls.pop(call, None)

    def _send(self, command) -> None:
        try:
            self.transport.send(command)
        except OSError as exc:  # the engine process is gone; its reader reports it
            raise EngineUnavailable(STOPPED) from exc

    # ------------------------------------------------------------------ the engine's outputs

    def _deliver(self, out: Outputs | None) -> None:
        """Called on the engine's thread (or the pipe reader's): hand `out` to the event loop.
        None: the engine loop ended."""
        try:
            self._loop.call_soon_threadsafe(self._apply, out)
        except RuntimeError:  # the event loop is closed: the server is gone
            pass

    def _apply(self, out: Outputs | None) -> None:
        if out is None:
            self._fail_all()
            return
        for call, result, error in out.results:
            future = self._calls.get(call)
            if future is None or future.done():  # the awaiting handler was cancelled
                continue
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)
        for gid, delta in out.events:
            group = self._groups.get(gid)
            if group is None:  # aborted: late events are dropped
                continue
            group.put(delta)
            if not group.unfinished:
                del self._groups[gid]
        self.snapshot, self.step_errors, self.aborted = out.snapshot, out.step_errors, out.aborted
        self._peak_memory = out.peak_memory

    def _fail_all(self) -> None:
        """The engine loop ended: answer everyone still waiting on it."""
        self._running = False
        for group in self._groups.values():
            for index in sorted(group.unfinished):
                group.put(Delta(index, [], None, "abort", error=STOPPED))
        self._groups.clear()
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineUnavailable(STOPPED))
