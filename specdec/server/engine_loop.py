"""The engine thread: one background thread owns the Engine and steps it.

Everything that touches the engine (adding, aborting, stepping, scoring) runs on that thread; the
asyncio side hands it work through a command queue and gets results back through
``loop.call_soon_threadsafe``.  After every step each tracked request's new tokens (and its finish)
go to the asyncio queue of the HTTP request that owns it, as `Delta` events.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

from specdec.engine.request import Request, TokenLogprobs
from specdec.sampling import SamplingParams, top_logprobs

log = logging.getLogger("specdec.server")


class EngineUnavailable(RuntimeError):
    """The engine thread is not running (not started yet, stopped, or dead)."""


@dataclasses.dataclass
class Delta:
    """What one request produced since the last event."""

    index: int  # which job (choice) of the HTTP request
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None  # set on the last event of the request
    text: str | None = None  # the final text when the engine cut it at a stop string
    error: str | None = None  # the request failed inside the engine


class Group:
    """The engine requests of one HTTP request and the asyncio queue their events go to."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.events: asyncio.Queue[Delta] = asyncio.Queue()
        self.requests: list[Request] = []

    def post(self, delta: Delta) -> None:
        _post(self.loop, self.events.put_nowait, delta)


@dataclasses.dataclass
class _Held:
    """A job waiting for an earlier job of its group with the same prompt (its leader) to be prefilled, so
    that it is admitted onto the leader's cached prompt blocks instead of computing them again."""

    group: Group
    index: int
    ids: list[int]
    params: SamplingParams
    leader: Request

    @property
    def ready(self) -> bool:  # a first output token means the whole prompt is computed and its blocks cached
        return self.leader.finished or bool(self.leader.output_token_ids)


@dataclasses.dataclass
class _Tracked:
    request: Request
    group: Group
    index: int
    sent: int = 0  # output tokens already posted


class EngineLoop:
    def __init__(self, llm, idle_poll_s: float = 0.1):
        self.llm = llm
        self.engine = llm.engine
        self.idle_poll_s = idle_poll_s
        self.commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.tracked: list[_Tracked] = []
        self.held: list[_Held] = []  # jobs added once their leader's prompt is cached
        self.deferred: list[tuple[int, Callable[[], None]]] = []  # (KV blocks needed, job)
        self.pending: set[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = set()  # calls not answered yet
        self.snapshot: dict[str, Any] = self.engine.metrics()
        self.step_errors = 0
        self.aborted = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)

    # ------------------------------------------------------------------ lifecycle (any thread)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self.commands.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    # ------------------------------------------------------------------ the asyncio side's API

    async def call(self, fn: Callable[[], Any], blocks_needed: int = 0) -> Any:
        """Run fn() on the engine thread and return its result (or raise its exception).

        With blocks_needed > 0 the job waits until that many KV blocks are free or the engine is idle:
        it is work outside the scheduler that borrows free blocks (scoring).
        """
        if not self.alive:
            raise EngineUnavailable("the engine is not running")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.pending.add((loop, future))

        def job():
            self.pending.discard((loop, future))
            try:
                result = fn()
            except Exception as exc:  # handed to the caller, never kills the thread
                _post(loop, _resolve, future, None, exc)
            else:
                _post(loop, _resolve, future, result, None)

        self.commands.put(job if blocks_needed <= 0 else lambda: self.deferred.append((blocks_needed, job)))
        return await future

    async def generate(self, jobs: list[tuple[list[int], SamplingParams]]) -> Group:
        """Queue one request per (prompt, params) job (all or none); their events arrive on the group's queue,
        each with its job's position as `Delta.index`."""
        group = Group(asyncio.get_running_loop())
        try:
            await self.call(lambda: self._add(group, jobs))
        except asyncio.CancelledError:  # the client left while the requests were being queued
            self.abort(group)
            raise
        return group

    def abort(self, group: Group) -> None:
        """Stop a group's unfinished requests and free their KV blocks (fire and forget)."""
        if self.alive:
            self.commands.put(lambda: self._abort(group))

    async def prompt_logprobs(self, token_ids: list[int], top_n: int) -> list[TokenLogprobs]:
        """Per prompt token: log p(token | tokens before it) and the top_n alternatives.

        The first token has no context: its entry's logprob and top are None.
        """
        first = TokenLogprobs(token_ids[0], None, None)  # type: ignore[arg-type]
        if len(token_ids) < 2:
            return [first]
        blocks = self.engine.blocks.blocks_for(len(token_ids) - 1)
        return [first] + await self.call(lambda: self._score(token_ids, top_n), blocks_needed=blocks)

    # ------------------------------------------------------------------ the engine thread

    def _run(self) -> None:
        try:
            while not self._stopping:
                try:
                    self._iteration()
                except Exception:  # a bug here must not take the server down
                    log.exception("engine loop iteration failed")
        finally:  # stopping (or dying): answer everyone still waiting on this thread
            self._stopping = True
            for t in [*self.tracked, *self.held]:
                t.group.post(Delta(t.index, [], None, "abort", error="the engine stopped"))
            for loop, future in list(self.pending):
                _post(loop, _resolve, future, None, EngineUnavailable("the engine stopped"))

    def _iteration(self) -> None:
        if not self._drain(block=not self.engine.has_work() and not self.deferred and not self.held):
            return
        self._run_deferred()
        self._release_held()
        if self.engine.has_work():
            self._step()
        self._publish()
        self.snapshot = self.engine.metrics()

    def _drain(self, block: bool) -> bool:
        """Run queued commands; False when asked to stop."""
        try:
            command = self.commands.get(timeout=self.idle_poll_s) if block else self.commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command is None:
                return False
            command()
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return True

    def _run_deferred(self) -> None:
        waiting = []
        for blocks, job in self.deferred:
            if blocks <= self.engine.blocks.num_free or not self.engine.has_work():
                job()  # an idle engine runs it even if it cannot fit: the job reports the error
            else:
                waiting.append((blocks, job))
        self.deferred = waiting

    def _step(self) -> None:
        try:
            self.engine.step()
        except Exception as exc:
            log.exception("engine step failed")
            self.step_errors += 1
            self._fail_running(f"the engine failed while serving this request: {type(exc).__name__}: {exc}")

    def _fail_running(self, message: str) -> None:
        """Fail the requests a broken step touched, so the rest keep being served."""
        scheduler = self.engine.scheduler
        victims = list(scheduler.running) or list(scheduler.waiting)[:1]  # always make progress
        for req in victims:
            req.error = message
            try:
                self.engine.abort(req)
            except Exception:
                log.exception("abort after a failed step failed")
                for pool in (scheduler.running, scheduler.waiting):
                    if req in pool:
                        pool.remove(req)
                req.finish("abort")

    def _add(self, group: Group, jobs: list[tuple[list[int], SamplingParams]]) -> None:
        for ids, params in jobs:
            self.engine.validate_request(ids, params)
        leaders: dict[tuple[int, ...], Request] = {}
        for index, (ids, params) in enumerate(jobs):
            leader = leaders.get(tuple(ids))
            if leader is not None:
                self.held.append(_Held(group, index, ids, params, leader))
                continue
            req = self._add_one(group, index, ids, params)
            if len(ids) >= self.engine.blocks.block_size:  # a full block to share: later copies wait for it
                leaders[tuple(ids)] = req

    def _add_one(self, group: Group, index: int, ids: list[int], params: SamplingParams) -> Request:
        req = self.engine.add_request(ids, params)
        group.requests.append(req)
        self.tracked.append(_Tracked(req, group, index))
        return req

    def _release_held(self) -> None:
        waiting = []
        for h in self.held:
            if not h.ready:
                waiting.append(h)
                continue
            try:
                self._add_one(h.group, h.index, h.ids, h.params)
            except Exception as exc:  # validated when queued: only a changed engine gets here
                log.exception("adding a held request failed")
                h.group.post(Delta(h.index, [], None, "abort", error=f"{type(exc).__name__}: {exc}"))
        self.held = waiting

    def _abort(self, group: Group) -> None:
        for t in [t for t in self.tracked if t.group is group]:
            if not t.request.finished:
                self.engine.abort(t.request)
                self.aborted += 1
        self.tracked = [t for t in self.tracked if t.group is not group]
        self.held = [h for h in self.held if h.group is not group]
        self.snapshot = self.engine.metrics()

    def _publish(self) -> None:
        still_running = []
        for t in self.tracked:
            req = t.request
            n = len(req.output_token_ids)
            if n > t.sent or req.finished:
                logprobs = req.logprobs[t.sent:n] if req.params.logprobs is not None else None
                delta = Delta(t.index, req.output_token_ids[t.sent:n], logprobs)
                if req.finished:
                    delta.finish_reason, delta.text, delta.error = req.finish_reason, req.text, req.error
                t.group.post(delta)
                t.sent = n
            if not req.finished:
                still_running.append(t)
        self.tracked = still_running

    @torch.inference_mode()
    def _score(self, token_ids: list[int], top_n: int) -> list[TokenLogprobs]:
        rows = self.engine.all_logits(token_ids[:-1])  # the same pass as Engine.score
        targets = torch.tensor(token_ids[1:], device=rows.device)
        chosen, top_ids, top_vals = top_logprobs(rows, targets, top_n)
        return [TokenLogprobs(t, lp, list(zip(ti, tv)))
                for t, lp, ti, tv in zip(token_ids[1:], chosen.tolist(), top_ids.tolist(), top_vals.tolist())]


def _post(loop: asyncio.AbstractEventLoop, fn: Callable, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the event loop is closed: the client side is gone
        pass


def _resolve(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.done():  # the awaiting handler was cancelled
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
