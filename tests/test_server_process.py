"""`specdec.server.process.serve`: after a graceful SIGTERM shutdown the process exits with status 0.

uvicorn alone raises the signal again once it has shut down, so the process dies of it (status -15) and a
graceful shutdown looks like a kill; the requests in flight are finished either way."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

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
