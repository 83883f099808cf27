"""Die with the parent: a process started by a supervisor (`specdec judge`) ends itself once that supervisor is gone.

A supervisor that is killed with SIGKILL (a time limit's `timeout -s KILL`, the OOM killer, a CI runner)
cannot stop what it started, and a server started in a session of its own gets no signal either: it would
keep holding the GPU's memory and fail the next run on the machine.  So the supervisor names itself in the
environment of what it starts (`SPECDEC_PARENT_PID`, see `child_env`), and a server that calls
`exit_with_parent()` watches that process from a daemon thread: once it is gone (or a zombie) the server
writes one line to stderr saying why, kills every process it started itself (the engine process) and exits
with status `PARENT_GONE`, within about `POLL_S` seconds.

Why a pid in the environment and not a pipe whose write end only the supervisor holds: the variable passes
through any wrapper (`bash -c`, `timeout`, `env`), is easy for any supervisor to give (`SPECDEC_PARENT_PID=$$`
in a shell), and cannot be kept open by accident by another process the supervisor forks.  psutil remembers
the watched process's start time, so a pid reused by a new process does not read as the old one alive.
Linux's PR_SET_PDEATHSIG is no substitute: it fires when the forking *thread* ends, and the judge launches
engines from threads.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Mapping

import psutil

from specdec.errors import ConfigError

ENV = "SPECDEC_PARENT_PID"
POLL_S = 0.5
PARENT_GONE = 1  # the exit status when the watched process went away


def child_env(pid: int | None = None, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a child that should end with process `pid` (default: this process)."""
    env = dict(os.environ if environ is None else environ)
    env[ENV] = str(os.getpid() if pid is None else pid)
    return env


def parent_pid(environ: Mapping[str, str] | None = None) -> int | None:
    """The pid named by SPECDEC_PARENT_PID, or None where it is unset or empty (watching is off)."""
    value = (os.environ if environ is None else environ).get(ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) <= 0:
        raise ConfigError(f"{ENV}={value!r} is not a process id (a positive integer)")
    return int(value)


def is_gone(process: psutil.Process) -> bool:
    """True once the process has ended: exited, replaced by another with its pid, or a zombie nobody reaped."""
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def kill_descendants() -> None:
    """SIGKILL every process this one started (and theirs): nobody is left to wait for them to finish."""
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        try:
            child.kill()
        except psutil.Error:
            pass


def _watch(pid: int, process: psutil.Process | None, poll_s: float) -> None:
    while process is not None and not is_gone(process):
        time.sleep(poll_s)
    sys.stderr.write(f"specdec: parent process {pid} ({ENV}) is gone: stopping this process and its children\n")
    sys.stderr.flush()
    kill_descendants()
    os._exit(PARENT_GONE)  # no graceful shutdown: the client it would finish requests for is gone


def watch_parent(pid: int, poll_s: float = POLL_S) -> threading.Thread:
    """Start a daemon thread that ends this process (and what it started) once process `pid` is gone."""
    try:
        process = psutil.Process(pid)
    except psutil.Error:  # gone already: the thread ends us at once
        process = None
    thread = threading.Thread(target=_watch, args=(pid, process, poll_s), name="specdec-parent-watch", daemon=True)
    thread.start()
    return thread


def exit_with_parent(environ: Mapping[str, str] | None = None, poll_s: float = POLL_S) -> threading.Thread | None:
    """Watch the process SPECDEC_PARENT_PID names, if it names one (off otherwise); see the module's docstring."""
    pid = parent_pid(environ)
    return None if pid is None else watch_parent(pid, poll_s)
