"""A drafter behind a /draft server (docs/DRAFTING.md), as a speculator of the engine.

Each step the contexts of all decoding requests go out concurrently, each with its own timeout; the
answers are deterministic drafts (draft_probs None).  Whatever the server does, the engine's output cannot
change: a failed, late or malformed answer is simply no draft, and only ids in [0, vocab_size) are ever
proposed, which the target then verifies.  When whole steps fail ``max_failed_steps`` times in a row the
speculator stops calling for ``backoff_s`` seconds (doubling on every further failure, up to
``max_backoff_s``): the engine decodes without speculation meanwhile, and ``metrics()`` says so.
"""

from __future__ import annotations

import concurrent.futures
import time

from specdec.drafting.protocol import FailureTally, base_url, draft_or_empty, make_client
from specdec.engine.request import Request
from specdec.speculate.base import Speculator


class RemoteSpeculator(Speculator):
    name = "remote"

    def __init__(self, url: str, timeout_s: float = 2.0, vocab_size: int | None = None, max_workers: int = 64,
                 max_failed_steps: int = 3, backoff_s: float = 1.0, max_backoff_s: float = 30.0):
        self.url = base_url(url)
        self.timeout_s = timeout_s
        self.vocab_size = vocab_size
        self.client = make_client(max_workers, timeout_s)
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="remote-draft")
        self.tally = FailureTally()
        self.max_failed_steps = max_failed_steps
        self.initial_backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.backoff_s = backoff_s
        self.failed_steps = 0  # consecutive steps in which every request failed
        self.paused_until = 0.0  # monotonic time before which no request is sent
        self.stats = {"remote_skipped": 0, "remote_fallbacks": 0, "remote_late": 0}

    @property
    def in_fallback(self) -> bool:
        return time.monotonic() < self.paused_until

    def propose(self, requests: list[Request], ks: list[int]) -> None:
        for req in requests:
            req.draft_token_ids, req.draft_probs = [], None
        asked = [(req, k) for req, k in zip(requests, ks) if k > 0]
        if not asked:
            return
        if self.in_fallback:
            self.stats["remote_skipped"] += len(asked)
            return
        failures_before = self.tally.failures
        jobs = [(req, self.pool.submit(draft_or_empty, self.client, self.url, req.all_token_ids, k, self.tally,
                                       self.vocab_size, self.timeout_s)) for req, k in asked]
        deadline = time.monotonic() + self.timeout_s + 0.5  # the per-request timeout bounds each phase only
        for req, job in jobs:
            try:
                req.draft_token_ids = job.result(timeout=max(0.0, deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                self.stats["remote_late"] += 1
        late = sum(not job.done() for _, job in jobs)
        self._track_health(self.tally.failures - failures_before + late == len(asked))

    def _track_health(self, step_failed: bool) -> None:
        if not step_failed:
            self.failed_steps, self.backoff_s = 0, self.initial_backoff_s
            return
        self.failed_steps += 1
        if self.failed_steps >= self.max_failed_steps:
            self.paused_until = time.monotonic() + self.backoff_s
            self.stats["remote_fallbacks"] += 1
            self.backoff_s = min(self.max_backoff_s, self.backoff_s * 2)
            self.failed_steps = self.max_failed_steps - 1  # after the pause one more failed step pauses again

    def metrics(self) -> dict:
        kinds = self.tally.kinds()
        return {
            "remote_url": self.url,
            "remote_requests": self.tally.requests,
            "remote_failures": self.tally.failures,  # each one an empty draft
            "remote_errors": kinds["error"],  # error status or no connection
            "remote_timeouts": kinds["timeout"],
            "remote_malformed": kinds["malformed"],  # bad JSON, ids out of range, more than k ids
            "remote_last_failure": self.tally.last_detail,
            "remote_fallback": self.in_fallback,  # True: the server is being left alone, no speculation now
            **self.stats,  # remote_fallbacks: pauses so far; remote_skipped: requests not sent during them
        }

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()
