"""The engine side of the server: one loop owns the Engine, runs the commands it is sent and steps it.

It runs either on a thread of the server process or in an engine process of its own
(`engine_process.py`); either way it talks only in the plain, picklable messages below:

  in:  Add(call, group, jobs) | Abort(group) | Score(call, token_ids, top_n) | None (stop)
  out: Outputs, one per loop iteration that did something: every group's new tokens (`Delta`s), the
       answers to calls, and the engine's metrics snapshot

so the cost of crossing a process boundary is one message per engine step, not one per token.
A group is the engine requests of one HTTP request, named by an int the server side chose.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import resource
import sys
from collections.abc import Callable
from typing import Any, Protocol

import torch

from specdec.engine.limits import RequestLimits
from specdec.engine.request import Request, TokenLogprobs
from specdec.sampling import SamplingParams, top_logprobs

log = logging.getLogger("specdec.server")

Job = tuple[list[int], SamplingParams]  # (prompt token ids, params) of one engine request


# ---------------------------------------------------------------------- messages to the engine


@dataclasses.dataclass
class Add:
    """Queue one engine request per job (all or none); answers None, or the InvalidRequestError."""

    call: int
    group: int
    jobs: list[Job]


@dataclasses.dataclass
class Abort:
    """Stop a group's unfinished requests and free their KV blocks (no answer)."""

    group: int


@dataclasses.dataclass
class Score:
    """Answers per prompt token after the first: log p(token | tokens before it) and the top_n alternatives.
    Runs outside the scheduler on borrowed KV blocks: waits until they are free or the engine is idle."""

    call: int
    token_ids: list[int]
    top_n: int


# ---------------------------------------------------------------------- messages from the engine


@dataclasses.dataclass
class Delta:
    """What one request produced since the last event."""

    index: int  # which job (choice) of the HTTP request
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None  # set on the last event of the request
    text: str | None = None  # the final text when the engine cut it at a stop string
    error: str | None = None  # the request failed inside the engine


@dataclasses.dataclass
class Outputs:
    events: list[tuple[int, Delta]]  # (group, delta), in order
    results: list[tuple[int, Any, BaseException | None]]  # (call, result, error)
    snapshot: dict[str, Any]  # Engine.metrics()
    step_errors: int
    aborted: int  # requests aborted because their client went away
    peak_memory: dict[str, int]  # {"device": bytes (GPU only), "rss": bytes} of the engine's process


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """What the HTTP side needs to know of the engine, sent once it is built."""

    model_dir: str
    limits: RequestLimits
    device: str
    has_tokenizer: bool  # the model directory has tokenizer.json (the HTTP side loads its own copy)

    @classmethod
    def of(cls, llm) -> "EngineInfo":
        return cls(str(llm.model_dir), llm.engine.limits, str(llm.engine.device), llm.tokenizer is not None)

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len


class Inbox(Protocol):
    """Where commands come from: a queue.SimpleQueue, or a pipe (engine_process.PipeInbox)."""

    def get(self, block: bool = True, timeout: float | None = None) -> Any: ...  # raises queue.Empty

    def get_nowait(self) -> Any: ...


# ---------------------------------------------------------------------- the loop


@dataclasses.dataclass
class _Held:
    """A job waiting for an earlier job of its group with the same prompt (its leader) to be prefilled, so
    that it is admitted onto the leader's cached prompt blocks instead of computing them again."""

    group: int
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
    group: int
    index: int
    sent: int = 0  # output tokens already posted


class EngineCore:
    def __init__(self, llm, idle_poll_s: float = 0.1):
        self.engine = llm.engine
        self.info = EngineInfo.of(llm)
        self.idle_poll_s = idle_poll_s
        self.tracked: list[_Tracked] = []
        self.held: list[_Held] = []  # jobs added once their leader's prompt is cached
        self.deferred: list[tuple[int, Callable[[], None]]] = []  # (KV blocks needed, job)
        self.step_errors = 0
        self.aborted = 0
        self._events: list[tuple[int, Delta]] = []
        self._results: list[tuple[int, Any, BaseException | None]] = []
        self._changed = False

    def run(self, inbox: Inbox, send: Callable[[Outputs], None]) -> None:
        """Serve commands until told to stop (None); `send` gets an Outputs after each iteration that did
        something.  An error in `send` (the server is gone) ends the loop."""
        send(self._outputs())
        while True:
            try:
                if not self._iteration(inbox):
                    return
            except Exception:  # a bug here must not take the server down
                log.exception("engine loop iteration failed")
            if self._changed or self._events or self._results:
                send(self._outputs())

    def _outputs(self) -> Outputs:
        out = Outputs(self._events, self._results, self.engine.metrics(), self.step_errors, self.aborted,
                      peak_memory(self.engine.device))
        self._events, self._results, self._changed = [], [], False
        return out

    def _iteration(self, inbox: Inbox) -> bool:
        """False when asked to stop."""
        if not self._drain(inbox, block=not self.engine.has_work() and not self.deferred and not self.held):
            return False
        self._run_deferred()
        self._release_held()
        if self.engine.has_work():
            self._changed = True
            self._step()
        self._publish()
        return True

    def _drain(self, inbox: Inbox, block: bool) -> bool:
        """Run queued commands; False when asked to stop."""
        try:
            command = inbox.get(timeout=self.idle_poll_s) if block else inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command is None:
                return False
            self._changed = True
            self._run(command)
            try:
                command = inbox.get_nowait()
            except queue.Empty:
                return True

    def _run(self, command: Add | Abort | Score) -> None:
        if isinstance(command, Add):
            self._answer(command.call, self._add, command.group, command.jobs)
        elif isinstance(command, Abort):
            self._abort(command.group)
        elif isinstance(command, Score):
            blocks = self.engine.blocks.blocks_for(len(command.token_ids) - 1)
            self.deferred.append(
                (blocks, lambda: self._answer(command.call, self._score, command.token_ids, command.top_n)))
        else:
            raise TypeError(f"unknown engine command {command!r}")

    def _answer(self, call: int, fn: Callable, *args) -> None:
        try:
            result = fn(*args)
        except Exception as exc:  # handed to the caller, never kills the loop
            self._results.append((call, None, exc))
        else:
            self._results.append((call, result, None))

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

    def _add(self, group: int, jobs: list[Job]) -> None:
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

    def _add_one(self, group: int, index: int, ids: list[int], params: SamplingParams) -> Request:
        req = self.engine.add_request(ids, params)
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
                self._events.append((h.group, Delta(h.index, [], None, "abort", error=f"{type(exc).__name__}: {exc}")))
        self.held = waiting

    def _abort(self, group: int) -> None:
        for t in [t for t in self.tracked if t.group == group]:
            if not t.request.finished:
                self.engine.abort(t.request)
                self.aborted += 1
        self.tracked = [t for t in self.tracked if t.group != group]
        self.held = [h for h in self.held if h.group != group]

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
                self._events.append((t.group, delta))
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


def peak_memory(device: torch.device) -> dict[str, int]:
    """This process's peak memory: device (GPU) allocations where there is a GPU, host RSS."""
    memory = {"device": torch.cuda.max_memory_allocated(device)} if device.type == "cuda" else {}
    memory["rss"] = peak_rss_bytes()
    return memory


def peak_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux reports KiB, macOS bytes
