"""Fake /draft servers built to known answers, on the standard library only (they start in a blink).

A behaviour maps (tokens, k) to an answer: ``(status, body bytes, delay seconds)``.  ``FakeDraftServer``
serves one in a background thread; ``python -m tests.fakes_draft.server --mode MODE --port N`` serves one
as a process (for the self-check, which launches commands).
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

Answer = tuple[int, bytes, float]


def ok(draft: list[int], delay: float = 0.0) -> Answer:
    return 200, json.dumps({"draft": draft}).encode(), delay


class Oracle:
    """Knows each conversation's continuation: finds where ``tokens`` stands in one of them."""

    def __init__(self, conversations: list[dict]):
        self.conversations = conversations

    def locate(self, tokens: list[int]) -> tuple[list[int], int] | None:
        """(continuation, pos) with tokens == prompt + continuation[:pos], or None."""
        for c in self.conversations:
            prompt, cont = c["prompt"], c["continuation"]
            pos = len(tokens) - len(prompt)
            if 0 <= pos <= len(cont) and tokens[:len(prompt)] == prompt and tokens[len(prompt):] == cont[:pos]:
                return cont, pos
        return None

    def right_for(self, j: int | None) -> Callable[[list[int], int], Answer]:
        """Drafts right for exactly j tokens (then one wrong token); j None = right for all k."""
        def answer(tokens: list[int], k: int) -> Answer:
            found = self.locate(tokens)
            if found is None:
                return ok([])
            cont, pos = found
            if j is None:
                return ok(cont[pos:pos + k])
            right = cont[pos:pos + min(j, k)]
            if len(right) == k or pos + len(right) >= len(cont):
                return ok(right)
            miss = cont[pos + len(right)]
            return ok(right + [miss - 1 if miss > 0 else miss + 1])
        return answer


def garbage(tokens: list[int], k: int) -> Answer:
    """Rotates through answers that break the protocol."""
    bodies = [b"<html>not json</html>", b'{"draft": "12 13"}', b'{"draft": [1.5, 2]}', b'{"draft": [-1]}',
              b'{"tokens": [1]}', json.dumps({"draft": list(range(k + 1))}).encode(), b"[]"]
    return 200, bodies[len(tokens) % len(bodies)], 0.0


class FakeDraftServer:
    """A behaviour served from a thread on 127.0.0.1.  ``die_after``: stop serving after N /draft answers."""

    def __init__(self, behaviour: Callable[[list[int], int], Answer], healthy: bool = True,
                 die_after: int | None = None, port: int = 0, on_die: Callable[[], None] | None = None):
        self.behaviour, self.healthy, self.die_after = behaviour, healthy, die_after
        self.on_die = on_die
        self.requests = 0
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> "FakeDraftServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                if self.path == "/health" and fake.healthy:
                    self._send(200, b'{"status": "ok"}')
                else:
                    self._send(503, b'{"status": "loading"}')

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if not fake.healthy or self.path != "/draft":
                    return self._send(503, b"{}")
                status, payload, delay = fake.behaviour(body["tokens"], body.get("k", 16))
                time.sleep(delay)
                self._send(status, payload)
                with fake.lock:
                    fake.requests += 1
                    dying = fake.die_after is not None and fake.requests == fake.die_after
                if dying:
                    (fake.on_die or (lambda: threading.Thread(target=fake.stop, daemon=True).start()))()

            def _send(self, status: int, payload: bytes):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
                self.wfile.flush()

        return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["never-healthy", "garbage", "dies-after", "empty"], required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--after", type=int, default=3, help="dies-after: answers before the process exits")
    args = parser.parse_args()
    behaviour = garbage if args.mode == "garbage" else lambda tokens, k: ok([])
    server = FakeDraftServer(behaviour, healthy=args.mode != "never-healthy", port=args.port,
                             die_after=args.after if args.mode == "dies-after" else None,
                             on_die=lambda: os._exit(3))
    server.httpd.serve_forever()


if __name__ == "__main__":
    main()
