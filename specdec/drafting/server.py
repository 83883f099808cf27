"""``specdec draft serve``: a drafter behind ``GET /health`` and ``POST /draft``, on loopback, offline.

Requests are batched: each /draft call queues its context; one worker thread takes everything pending,
drafts for all of it together (``PrefixCachedDrafter``) and answers each caller.  Bad input -- not JSON,
no token list, ids outside the drafter's vocabulary, k outside [0, MAX_K] -- is answered 400.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import queue
import threading
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from specdec.drafting.drafter import PrefixCachedDrafter
from specdec.drafting.protocol import DEFAULT_K

log = logging.getLogger("specdec.drafting")
MAX_K = 64
DEFAULT_MAX_KV_TOKENS = 1 << 20  # a default cache holds ~500 conversations of 2k tokens; more is only overhead
MAX_WAIT_S = 0.020  # the longest the first request of a batch waits for the others


@dataclasses.dataclass
class _Pending:
    tokens: list[int]
    k: int
    future: concurrent.futures.Future


class DraftBatcher:
    """One worker thread that owns the drafter and drafts for every pending request at once."""

    def __init__(self, drafter: PrefixCachedDrafter, max_batch: int = 64):
        self.drafter = drafter
        self.max_batch = max_batch
        self.pending: queue.Queue[_Pending | None] = queue.Queue()
        self.last_batch_size = 1
        self.thread = threading.Thread(target=self._run, name="drafter", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.pending.put(None)
        self.thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def submit(self, tokens: list[int], k: int) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.pending.put(_Pending(tokens, k, future))
        return future

    def _run(self) -> None:
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            try:
                drafts = self.drafter.draft([p.tokens for p in batch], [p.k for p in batch])
            except Exception as exc:  # noqa: BLE001 - answer the callers, keep serving
                log.exception("drafting a batch of %d failed", len(batch))
                for p in batch:
                    p.future.set_exception(exc)
                continue
            for p, draft in zip(batch, drafts):
                p.future.set_result(draft)

    def _take_batch(self) -> list[_Pending] | None:
        """Block for one request, then gather the rest of the batch (None: stop).

        The callers answered by the last batch send their next requests a moment later, while those that
        queued during it are already waiting: a batch waits (at most MAX_WAIT_S) for both, so that the
        conversations do not split into two alternating half-size batches.
        """
        backlog = self.pending.qsize()  # queued while the last batch ran
        first = self.pending.get()
        if first is None:
            return None
        batch = [first]
        target = min(self.max_batch, backlog + self.last_batch_size)
        deadline = time.monotonic() + MAX_WAIT_S
        while len(batch) < self.max_batch:
            try:
                wait = max(0.0, deadline - time.monotonic()) if len(batch) < target else 0.0
                item = self.pending.get(timeout=wait) if wait else self.pending.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self.pending.put(None)  # stop after this batch
                break
            batch.append(item)
        self.last_batch_size = len(batch)
        return batch


def parse_draft_request(body, vocab_size: int) -> tuple[list[int], int]:
    """(tokens, k) from a /draft body; raises ValueError saying what is wrong."""
    if not isinstance(body, dict):
        raise ValueError("the body must be a JSON object {\"tokens\": [...], \"k\": 16}")
    tokens, k = body.get("tokens"), body.get("k", DEFAULT_K)
    if not isinstance(tokens, list) or not tokens:
        raise ValueError("'tokens' must be a non-empty list of token ids")
    for t in tokens:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise ValueError(f"token {t!r} is not a token id in [0, {vocab_size})")
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_K:
        raise ValueError(f"'k' must be an integer in [0, {MAX_K}], got {k!r}")
    return tokens, k


def create_app(drafter: PrefixCachedDrafter, name: str = "drafter") -> FastAPI:
    batcher = DraftBatcher(drafter, drafter.max_batch)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        batcher.start()
        yield
        batcher.stop()

    app = FastAPI(title="specdec drafter", lifespan=lifespan)
    app.state.batcher = batcher

    @app.get("/health")
    async def health():
        if not batcher.alive:
            return JSONResponse({"status": "drafter worker is not running"}, status_code=503)
        return {"status": "ok", "model": name}

    @app.get("/metrics")
    async def metrics():
        return {"model": name, **drafter.metrics()}

    @app.post("/draft")
    async def draft(request: Request):
        try:
            body = await request.json()
        except ValueError as exc:
            return JSONResponse({"error": f"the body is not JSON: {exc}"}, status_code=400)
        try:
            tokens, k = parse_draft_request(body, drafter.vocab_size)
        except ValueError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        if not batcher.alive:
            return JSONResponse({"error": "drafter worker is not running"}, status_code=503)
        return {"draft": await asyncio.wrap_future(batcher.submit(tokens, k))}

    return app


def load_drafter(model: str, device: str | None = None, dtype: str | None = None,
                 kv_cache_tokens: int | None = None, block_size: int = 16, max_batch: int = 64) -> PrefixCachedDrafter:
    """A drafter from a model directory or short name (ref-draft), with its KV cache sized for serving."""
    from specdec.assets import resolve_model
    from specdec.engine.kv_cache import num_blocks_for
    from specdec.errors import ModelLoadError
    from specdec.devices import parse_dtype, pick_device
    from specdec.models.loader import load_model

    try:
        model_dir = resolve_model(model)
    except FileNotFoundError as exc:
        raise ModelLoadError(str(exc)) from exc
    from specdec.models.provenance import check_weights_sha256

    log.warning("%s", check_weights_sha256(model_dir))  # refuses (ModelLoadError) weights other than exported
    torch_device = pick_device(device)
    network = load_model(model_dir, torch_device, parse_dtype(dtype))
    weight_dtype = network.lm_head.weight.dtype
    tokens = num_blocks_for(network.config, block_size, weight_dtype, torch_device, kv_cache_tokens, 0.5) * block_size
    if kv_cache_tokens is None:
        tokens = min(tokens, DEFAULT_MAX_KV_TOKENS)
    return PrefixCachedDrafter(network, tokens, block_size, max_batch)


class ThreadedServer:
    """Uvicorn serving an app from a background thread (tests and benchmarks); port 0 = any free port."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                    access_log=False))
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.host = host

    def start(self, timeout_s: float = 30.0) -> "ThreadedServer":
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the drafter server did not start")
            time.sleep(0.01)
        return self

    @property
    def url(self) -> str:
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://{self.host}:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def __enter__(self) -> "ThreadedServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(model: str, host: str = "127.0.0.1", port: int = 8100, **load_options) -> None:
    """Load the drafter, then serve it until interrupted (GET /health answers only once it is loaded)."""
    from specdec.server.process import serve as serve_app

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a network, whatever gets imported
    drafter = load_drafter(model, **load_options)
    app = create_app(drafter, name=str(model))
    print(f"drafter {model} ({drafter.device}, KV cache {drafter.blocks.num_blocks * drafter.blocks.block_size} "
          f"tokens) on http://{host}:{port}", flush=True)
    serve_app(app, host, port, log_level="warning", access_log=False)
