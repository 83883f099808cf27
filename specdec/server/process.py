"""Serving an app in the foreground until SIGINT or SIGTERM, with an exit status that says how it ended.

uvicorn answers SIGINT / SIGTERM by shutting down gracefully (no new connections, requests in flight
finished, the lifespan's shutdown run), then raises the signal again with the handler it found installed:
with Python's defaults the process then dies of the signal (status -15 for SIGTERM) exactly as if it had
been killed at once, so a supervisor cannot tell a graceful shutdown from an abrupt one.  `serve` installs
a handler that ignores a signal raised again after serving started: the shutdown it asked for is done, and
the command returns normally (status 0).  A signal before serving started still acts as it always did.
"""

from __future__ import annotations

import signal
import sys

SIGNALS = (signal.SIGINT, signal.SIGTERM)
STARTUP_FAILURE = 3  # uvicorn.run's status when the server never started


def serve(app, host: str, port: int, **config) -> None:
    """Serve `app` on host:port (uvicorn.Config options in `config`) until SIGINT or SIGTERM; return after a
    graceful shutdown, exit with status 3 if serving never started (as uvicorn.run does)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, **config))
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}

    def after_uvicorn(sig: int, frame) -> None:
        if server.started:
            return  # uvicorn handled it: the graceful shutdown is done
        signal.signal(sig, previous[sig])  # not serving yet: the signal does what it did before
        signal.raise_signal(sig)

    for sig in SIGNALS:
        signal.signal(sig, after_uvicorn)
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started:
        sys.exit(STARTUP_FAILURE)
