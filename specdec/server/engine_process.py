"""The engine in a process of its own, so that its host work does not compete with the HTTP side for one
Python interpreter (the GIL).

The server process spawns (multiprocessing's "spawn": CUDA cannot be forked) one engine process, which
builds the LLM from an `EngineSpec` (the LLM constructor's arguments) and runs `EngineCore` on it.  Two
one-way pipes join them:

  server -> engine: the commands (Add / Abort / Score / None to stop), sent by the event loop
  engine -> server: Ready(EngineInfo) or Failed(message) once, then one `Outputs` per engine step, read by
                    one thread of the server process that hands each to the event loop

The engine process ignores SIGINT and SIGTERM once it is serving (a terminal's Ctrl-C and a supervisor's
signal to the process group reach it too): the server finishes its requests in flight, then tells it to
stop.  It stops by itself when the server process goes away (its command pipe reaches EOF).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing
import pickle
import queue
import signal
import threading
from collections.abc import Callable
from typing import Any

from specdec.errors import SpecdecError
from specdec.server.engine_core import EngineCore, EngineInfo, Outputs

log = logging.getLogger("specdec.server")


@dataclasses.dataclass
class EngineSpec:
    """How to build the engine: `LLM(model, **options)`, as `specdec serve` builds it from its flags."""

    model: str
    options: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Ready:
    info: EngineInfo


@dataclasses.dataclass
class Failed:
    message: str


class EngineStartError(SpecdecError):
    """The engine process could not build the engine, or died before it was ready."""


class EngineProcess:
    """The transport of `EngineLoop` to an engine process."""

    remote = True  # the engine's memory is another process's

    def __init__(self, spec: EngineSpec):
        self.spec = spec
        self.process: multiprocessing.process.BaseProcess | None = None
        self._commands = None  # our end of the command pipe
        self._events = None  # our end of the event pipe
        self._info: EngineInfo | None = None

    def launch(self) -> None:
        """Spawn the engine process and wait (minutes, on a GPU) until it is ready; raises EngineStartError
        naming why it could not start.  `specdec serve` calls it before opening its port, so that a bad model
        or flag ends the command with its reason alone; `start` calls it if nobody has."""
        if self.process is not None:
            return
        ctx = multiprocessing.get_context("spawn")
        commands_out, self._commands = ctx.Pipe(duplex=False)
        events, events_in = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=engine_process_main, args=(self.spec, commands_out, events_in),
                                   name="specdec-engine")
        self.process.start()
        atexit.register(self.stop)  # before multiprocessing's own exit hook, which would wait for the process
        commands_out.close()  # the engine process holds these ends now: each side sees EOF when the other dies
        events_in.close()
        first = self._first_message(events)
        if isinstance(first, Failed):
            self.stop()
            raise EngineStartError(f"the engine process failed to build the engine: {first.message}")
        self._events, self._info = events, first.info

    def start(self, deliver: Callable[[Outputs | None], None]) -> tuple[EngineInfo, Any]:
        """Launch the engine process if nobody has; then a thread passes what it sends to `deliver`."""
        self.launch()
        threading.Thread(target=self._read, args=(self._events, deliver), name="specdec-engine-reader",
                         daemon=True).start()
        log.info("engine process %d ready (%s on %s)", self.process.pid, self._info.model_dir, self._info.device)
        return self._info, _tokenizer(self._info)

    def _first_message(self, events) -> Ready | Failed:
        try:
            while not events.poll(0.5):  # a build can take minutes; a process killed meanwhile is noticed
                if not self.process.is_alive():
                    break
            return events.recv()
        except (EOFError, OSError):
            self.process.join(5)
            raise EngineStartError(f"the engine process exited (code {self.process.exitcode}) before it was "
                                   "ready: see its output above") from None

    def _read(self, events, deliver: Callable[[Outputs | None], None]) -> None:
        try:
            while True:
                deliver(events.recv())
        except (EOFError, OSError):  # the engine process ended
            pass
        finally:
            events.close()
            deliver(None)

    def send(self, command) -> None:
        self._commands.send(command)

    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the engine process to stop; kill it if it has not within `timeout` seconds."""
        atexit.unregister(self.stop)
        if self.process is None:
            return
        try:
            self._commands.send(None)
        except (OSError, ValueError):  # already gone, or this end already closed
            pass
        self.process.join(timeout)
        if self.process.is_alive():
            log.warning("the engine process did not stop within %g s: killing it", timeout)
            self.process.kill()
            self.process.join()
        self._commands.close()


class PipeInbox:
    """The engine process's commands, read like a queue.SimpleQueue; EOF (the server is gone) reads as stop."""

    def __init__(self, conn):
        self.conn = conn

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        if not self.conn.poll(timeout if block else 0):
            raise queue.Empty
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            return None

    def get_nowait(self) -> Any:
        return self.get(block=False)


def engine_process_main(spec: EngineSpec, commands, events) -> None:
    """The engine process: build the engine, report Ready (or Failed), then serve commands until told to stop
    or the server is gone."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s:     engine process: %(message)s")
    logging.getLogger("specdec.startup").setLevel(logging.INFO)  # what the start-up did, a line per phase
    try:
        from specdec import LLM

        core = EngineCore(LLM(spec.model, **spec.options))
    except KeyboardInterrupt:  # Ctrl-C while building: the server gives up too
        return
    except Exception as exc:
        if not isinstance(exc, SpecdecError):  # a bug, not a bad argument: keep the traceback
            log.exception("building the engine failed")
        events.send(Failed(f"{type(exc).__name__}: {exc}"))
        return
    for sig in (signal.SIGINT, signal.SIGTERM):  # the server decides when this process stops
        signal.signal(sig, signal.SIG_IGN)
    events.send(Ready(core.info))
    try:
        core.run(PipeInbox(commands), lambda out: events.send(_picklable(out)))
    except (BrokenPipeError, ConnectionResetError, EOFError):  # the server is gone
        pass


def _picklable(out: Outputs) -> Outputs:
    """out, with any call's error that cannot cross the pipe replaced by one saying what it was."""
    for i, (call, result, error) in enumerate(out.results):
        if error is not None:
            try:
                pickle.dumps(error)
            except Exception:
                out.results[i] = (call, None, RuntimeError(f"{type(error).__name__}: {error}"))
    return out


def _tokenizer(info: EngineInfo):
    if not info.has_tokenizer:
        return None
    from specdec.tokenizer import Tokenizer

    return Tokenizer(info.model_dir)
