"""`specdec.server.process.serve`: after a graceful SIGTERM shutdown the process exits with status 0.

uvicorn alone raises the signal again once it has shut down, so the process dies of it (status -15) and a
graceful shutdown looks like a kill; the requests in flight are finished either way."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import psutil

APP = """
import asyncio, sys
from fastapi import FastAPI
from specdec.server.process import serve

app = FastAPI()

@app.get("/slow")
async def slow():
    await asyncio.sleep(1.0)
    return {"done": True}

serve(app, "127.0.0.1", int(sys.argv[1]), log_level="warning")
print("returned", flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_listening(url: str, process: subprocess.Popen, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[0]
        try:
            httpx.get(f"{url}/docs", timeout=1.0)
            return
        except httpx.HTTPError:
            time.sleep(0.05)
    raise AssertionError("the server did not start")


def test_sigterm_finishes_requests_in_flight_and_exits_0():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen([sys.executable, "-c", APP, str(port)], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        wait_listening(url, process)
        replies = []
        request = threading.Thread(target=lambda: replies.append(httpx.get(f"{url}/slow", timeout=10.0)))
        request.start()
        time.sleep(0.3)  # the request is in flight
        process.send_signal(signal.SIGTERM)
        request.join(10)
        status = process.wait(15)
        output = process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert [r.status_code for r in replies] == [200]
    assert status == 0, f"exit status {status} after a graceful shutdown: {output}"
    assert "returned" in output  # serve() returned to its caller


def serve_command(model, port: int) -> list[str]:
    return [sys.executable, "-m", "specdec.cli", "serve", str(model), "--device", "cpu", "--dtype", "float32",
            "--kv-cache-tokens", "4096", "--block-size", "4", "--port", str(port), "--log-level", "warning"]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_serve_sigterm_to_its_group_finishes_requests_and_stops_the_engine_process(qwen3_dir):
    """As a supervisor (or the judge) stops it: SIGTERM to the process group, which the engine process is in."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(serve_command(qwen3_dir, port), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        wait_listening(url, process, timeout_s=120)
        children = psutil.Process(process.pid).children(recursive=True)
        assert children  # the engine process (and multiprocessing's resource tracker)
        replies, started = [], threading.Event()

        def stream():
            body = {"prompt": [5, 6, 7], "max_tokens": 60, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    started.set()
                    if line:
                        replies.append(line)

        request = threading.Thread(target=stream)
        request.start()
        assert started.wait(30)
        os.killpg(process.pid, signal.SIGTERM)
        request.join(60)
        status = process.wait(30)
        output = process.stdout.read()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert status == 0, f"exit status {status} after a graceful shutdown: {output}"
    finished = [json.loads(r[5:]) for r in replies if r.startswith("data: {")]
    assert finished[-1]["choices"][0]["finish_reason"] == "length" and replies[-1] == "data: [DONE]"
    deadline = time.monotonic() + 10
    while not all(gone(c.pid) for c in children):
        assert time.monotonic() < deadline, f"left behind: {[c.pid for c in children if not gone(c.pid)]}"
        time.sleep(0.1)


def test_serve_ends_itself_and_its_engine_process_once_its_parent_is_killed(qwen3_dir):
    """As when the judge is killed with SIGKILL: the process SPECDEC_PARENT_PID names goes, and so does serve."""
    parent = subprocess.Popen(["sleep", "600"])  # the judge's stand-in, left unreaped (a zombie) once killed
    port = free_port()
    env = {**os.environ, "SPECDEC_PARENT_PID": str(parent.pid)}
    process = subprocess.Popen(serve_command(qwen3_dir, port), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True, env=env)
    try:
        wait_listening(f"http://127.0.0.1:{port}", process, timeout_s=120)
        children = psutil.Process(process.pid).children(recursive=True)
        assert children and process.poll() is None  # the engine process; the parent lives, serve does too
        parent.kill()
        started = time.monotonic()
        status = process.wait(10)
        took = time.monotonic() - started
        output = process.stdout.read()
    finally:
        parent.kill()
        parent.wait()
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert status == 1 and f"parent process {parent.pid} (SPECDEC_PARENT_PID) is gone" in output, output
    assert took < 3.0, f"serve took {took:.1f} s to notice its parent was gone"
    deadline = time.monotonic() + 5
    while not all(gone(c.pid) for c in children):
        assert time.monotonic() < deadline, f"left behind: {[c.pid for c in children if not gone(c.pid)]}"
        time.sleep(0.1)


def test_a_judge_killed_with_sigkill_leaves_no_server_behind(qwen3_dir, tmp_path):
    """The defect end to end: `specdec judge` launching two `specdec serve` engines is SIGKILLed (as by
    `timeout -s KILL`); every process it started, servers and engine processes, is gone soon after."""
    engine = shlex.join(serve_command(qwen3_dir, "{port}"))
    judge = subprocess.Popen([sys.executable, "-m", "specdec.cli", "judge", "--stock", engine, "--candidate", engine,
                              "--model", "m", "--layout", "together", "--quiet", "--out", str(tmp_path / "out")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    left: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and judge.poll() is None:  # both servers up, each with its engine
            servers = psutil.Process(judge.pid).children()
            if len(servers) == 2 and all(s.children() for s in servers):
                break
            time.sleep(0.2)
        left = psutil.Process(judge.pid).children(recursive=True)
        assert len(left) >= 4, f"the judge did not start both servers and their engines: {left}"
        judge.kill()
        deadline = time.monotonic() + 5
        while any(not gone(p.pid) for p in left) and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = [p.pid for p in left if not gone(p.pid)]
    finally:
        judge.kill()
        judge.wait()
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.kill()
    assert not survivors, f"still running 5 s after the judge was killed: {survivors}"


def test_serve_a_model_that_cannot_be_built_exits_naming_the_problem(tmp_path):
    missing = tmp_path / "no-such-model"
    run = subprocess.run(serve_command(missing, free_port()), capture_output=True, text=True, timeout=120)
    assert run.returncode == 2  # the command's status for bad input: the engine is built before the port opens
    assert "the engine process failed to build the engine: ModelLoadError" in run.stderr
    assert str(missing) in run.stderr
    assert "Traceback" not in run.stderr and "Started server process" not in run.stderr  # its reason alone
