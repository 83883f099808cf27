"""A drafter behind a /draft server (docs/DRAFTING.md), as a speculator of the engine.

Each step the contexts of all decoding requests go out concurrently, each with its own timeout; the
answers are deterministic drafts (draft_probs None).  Whatever the server does, the engine's output cannot
change: a failed, late or malformed answer is simply no draft, and only ids in [0, vocab_size) are ever
proposed, which the target then verifies.  When whole steps fail ``max_failed_steps`` times in a row the
speculator stops calling for ``backoff_s`` seconds (doubling on every further failure, up to
``max_backoff_s``): the engine decodes without speculation meanwhile, and ``metrics()`` says so.

The drafter's health is logged once per change, never per call: a warning naming the URL and the reason
when a step in which every request failed follows a healthy one, and an info line when a step gets an
answer again.  Failures are counted by reason (``REASONS``) and recoveries in ``metrics()``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time

import httpx

from specdec.drafting.protocol import DraftFailure, FailureTally, base_url, fetch_draft, make_client
from specdec.engine.request import Request
from specdec.speculate.base import Speculator

log = logging.getLogger(__name__)

# why a /draft call failed -> how the log names it
REASONS = {
    "timeout": "timeout",
    "refused": "connection refused",  # no connection could be made (httpx.ConnectError)
    "connection": "connection error",  # the connection broke mid-call
    "status": "error status",  # an HTTP status other than 200
    "malformed": "malformed reply",  # not JSON, no draft list, ids out of range, more than k ids
}


def failure_reason(failure: DraftFailure) -> str:
    """The REASONS key of a failed /draft call."""
    if failure.kind != "error":
        return failure.kind  # "timeout" or "malformed"
    if isinstance(failure.__cause__, httpx.ConnectError):
        return "refused"
    return "connection" if failure.__cause__ is not None else "status"


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
        self.reasons: collections.Counter[str] = collections.Counter()  # failed calls by REASONS key
        self.reasons_lock = threading.Lock()  # the calls run in the pool's threads
        self.max_failed_steps = max_failed_steps
        self.initial_backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.backoff_s = backoff_s
        self.failed_steps = 0  # consecutive steps in which every request failed
        self.failed_calls = 0  # failed calls since the drafter was last healthy (0: healthy)
        self.paused_until = 0.0  # monotonic time before which no request is sent
        self.stats = {"remote_skipped": 0, "remote_fallbacks": 0, "remote_late": 0, "remote_recoveries": 0}

    @property
    def in_fallback(self) -> bool:
        return time.monotonic() < self.paused_until

    @property
    def failing(self) -> bool:
        return self.failed_calls > 0

    def propose(self, requests: list[Request], ks: list[int]) -> None:
        for req in requests:
            req.clear_drafts()
        asked = [(req, k) for req, k in zip(requests, ks) if k > 0]
        if not asked:
            return
        if self.in_fallback:
            self.stats["remote_skipped"] += len(asked)
            return
        jobs = [(req, self.pool.submit(self._draft, req.all_token_ids, k)) for req, k in asked]
        deadline = time.monotonic() + self.timeout_s + 0.5  # the per-request timeout bounds each phase only
        failures = [self._collect(req, job, deadline) for req, job in jobs]
        step_failed = all(failure is not None for failure in failures)
        self._log_health(step_failed, failures)
        self._track_health(step_failed)

    def _draft(self, tokens: list[int], k: int) -> tuple[list[int], DraftFailure | None]:
        """One /draft call (in a pool thread): the draft, or [] and why not; counted either way."""
        try:
            draft = fetch_draft(self.client, self.url, tokens, k, self.vocab_size, self.timeout_s)
        except DraftFailure as failure:
            self.tally.record(failure)
            with self.reasons_lock:
                self.reasons[failure_reason(failure)] += 1
            return [], failure
        self.tally.record(None)
        return draft, None

    def _collect(self, req: Request, job: concurrent.futures.Future, deadline: float) -> DraftFailure | None:
        """Sets req's draft from its job; returns the call's failure, if any (a late job counts as a timeout
        here, and is tallied by its own thread when it ends)."""
        try:
            req.draft_token_ids, failure = job.result(timeout=max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            self.stats["remote_late"] += 1
            return DraftFailure("timeout", f"no answer within {self.timeout_s + 0.5:.1f} s")
        return failure

    def _log_health(self, step_failed: bool, failures: list[DraftFailure | None]) -> None:
        """One warning when the drafter starts failing, one info line when it answers again."""
        failed = [failure for failure in failures if failure is not None]
        if step_failed:
            if not self.failing:
                first = failed[0]
                log.warning("drafter at %s failing: %s (%s); decoding without its drafts, retrying with back-off",
                            self.url, REASONS[failure_reason(first)], first.detail)
            self.failed_calls += len(failed)
        elif self.failing:
            log.info("drafter at %s answering again after %d failed calls", self.url, self.failed_calls)
            self.stats["remote_recoveries"] += 1
            self.failed_calls = 0

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
        with self.reasons_lock:
            by_reason = {reason: self.reasons[reason] for reason in REASONS}
        return {
            "remote_url": self.url,
            "remote_requests": self.tally.requests,
            "remote_failures": self.tally.failures,  # each one an empty draft
            "remote_errors": kinds["error"],  # error status or no connection
            "remote_timeouts": kinds["timeout"],
            "remote_malformed": kinds["malformed"],  # bad JSON, ids out of range, more than k ids
            "remote_failures_by_reason": by_reason,  # the failures again, split by REASONS key
            "remote_last_failure": self.tally.last_detail,
            "remote_failing": self.failing,  # True from a step in which every call failed to one answered
            "remote_fallback": self.in_fallback,  # True: the server is being left alone, no speculation now
            **self.stats,  # remote_fallbacks: pauses so far; remote_skipped: requests not sent during them;
            #                remote_recoveries: times it answered again after failing
        }

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()
