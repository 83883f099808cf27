"""Die with the parent (specdec/parent_watch.py): a server the judge started ends itself, and what it started,
once the judge is killed with SIGKILL; the judge names itself in its engines' environment."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from specdec.errors import ConfigError
from specdec.judge.engines import Engine
from specdec.parent_watch import ENV, child_env, exit_with_parent, parent_pid

REPO = Path(__file__).resolve().parents[1]

# The watched process (the judge's stand-in): starts WATCHER in a session of its own with SPECDEC_PARENT_PID
# naming itself, prints the watcher's pid, then waits to be killed.
SUPERVISOR = textwrap.dedent("""
    import subprocess, sys, time
    from specdec.parent_watch import child_env
    watcher = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=child_env(), start_new_session=True,
                               stderr=open(sys.argv[2], "w"))
    print(watcher.pid, flush=True)
    time.sleep(600)
""")

# The server's stand-in: watches its parent, starts a grandchild of its own (the engine process's stand-in),
# prints that one's pid, then would live for ten minutes.
WATCHER = textwrap.dedent("""
    import subprocess, time
    from specdec.parent_watch import exit_with_parent
    exit_with_parent(poll_s=0.2)
    engine = subprocess.Popen(["sleep", "600"])
    print(engine.pid, flush=True)
    time.sleep(600)
""")


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(pids: list[int], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(gone(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def kill_quietly(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_watcher_lives_while_its_parent_does_and_ends_with_its_children_once_it_is_killed(tmp_path):
    log = tmp_path / "watcher.err"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop(ENV, None)
    supervisor = subprocess.Popen([sys.executable, "-c", SUPERVISOR, WATCHER, str(log)], env=env,
                                  stdout=subprocess.PIPE, text=True)
    pids = [supervisor.pid]
    try:
        watcher = int(supervisor.stdout.readline())
        pids.append(watcher)
        engine = int(supervisor.stdout.readline())  # the watcher's stdout is the supervisor's: the same pipe
        pids.append(engine)
        time.sleep(1.5)  # several polls: the control, the parent alive, nothing ends
        assert not gone(watcher) and not gone(engine), log.read_text()
        supervisor.kill()  # SIGKILL, and not reaped yet: the watcher must take a zombie for gone too
        started = time.monotonic()
        assert wait_gone([watcher, engine], 5.0), "the watcher or its child outlived the killed parent"
        assert time.monotonic() - started < 3.0
        assert f"parent process {supervisor.pid} ({ENV}) is gone" in log.read_text()
    finally:
        kill_quietly(pids)
        supervisor.wait()


def test_a_parent_gone_before_the_watch_starts_ends_the_process_at_once(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    code = "from specdec.parent_watch import exit_with_parent; import time; exit_with_parent(); time.sleep(60)"
    env = {**os.environ, "PYTHONPATH": str(REPO), ENV: str(dead.pid)}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and "is gone" in done.stderr
    assert time.monotonic() - started < 20


def test_watching_is_off_without_the_variable_and_a_bad_value_is_refused():
    assert parent_pid({}) is None and parent_pid({ENV: " "}) is None
    assert exit_with_parent({}) is None
    assert parent_pid({ENV: "123"}) == 123
    for bad in ("abc", "-5", "0"):
        with pytest.raises(ConfigError, match=ENV):
            parent_pid({ENV: bad})
    assert child_env(42, {"A": "b"}) == {"A": "b", ENV: "42"}


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads a process's environment from /proc")
def test_the_judge_names_itself_to_its_engines_and_stop_ends_their_whole_group(tmp_path):
    # a shell (the engine) that starts a child of its own in its group; `--port N` is appended to the command
    engine = Engine("stock", "sh -c 'sleep 600 & sleep 600'", tmp_path)
    engine.launch()
    try:
        shell = psutil.Process(engine.proc.pid)
        deadline = time.monotonic() + 10
        # read while the shell may still be in exec (its environ reads empty then, as CI saw once in a while)
        while not (environ := Path(f"/proc/{shell.pid}/environ").read_bytes()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert f"{ENV}={os.getpid()}".encode() in environ.split(b"\0")
        while len(shell.children()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        group = [shell.pid] + [c.pid for c in shell.children()]
        assert len(group) == 3
    finally:
        engine.stop()
    assert wait_gone(group, 5.0), "a process of the engine's group outlived stop()"
    assert engine.exit_codes == [-signal.SIGTERM]


def test_sigterm_to_the_judge_stops_the_engines_it_started(tmp_path):
    """A graceful end by signal (a supervisor's SIGTERM) stops the engines too: they are in sessions of their own,
    so the signal does not reach them, and Python's default would end the judge without its `finally`."""
    never_healthy = "sh -c 'sleep 600'"
    argv = [sys.executable, "-m", "specdec.cli", "judge", "--stock", never_healthy, "--candidate", never_healthy,
            "--model", "m", "--layout", "together", "--quiet", "--out", str(tmp_path / "out")]
    judge = subprocess.Popen(argv, env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=subprocess.PIPE, text=True)
    engines: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(engines) < 2 and time.monotonic() < deadline and judge.poll() is None:
            time.sleep(0.1)
            engines = [c.pid for c in psutil.Process(judge.pid).children()]
        assert len(engines) == 2, "the judge did not launch both engines"
        judge.send_signal(signal.SIGTERM)
        status = judge.wait(60)
        stopped = wait_gone(engines, 5.0)  # before the clean-up below kills whatever is left
    finally:
        kill_quietly([judge.pid])
        judge.wait()
        for group in engines:  # each engine leads a session (and process group) of its own
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
    assert status == 128 + signal.SIGTERM, judge.stderr.read()
    assert stopped, "an engine outlived the judge's SIGTERM"
