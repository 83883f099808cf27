"""The /draft protocol, client side: the answer's rules and the one call every consumer makes.

``POST {url}/draft`` with ``{"tokens": [...], "k": k}`` answers ``{"draft": [...]}``: at most k ints, each a
token id in [0, vocab_size).  Anything else -- an error status, a timeout, a refused connection, bad JSON,
ids out of range, too many ids -- counts as an empty draft, and as one failure of its kind.
"""

from __future__ import annotations

import collections
import threading

import httpx

DEFAULT_K = 16
FAILURE_KINDS = ("error", "timeout", "malformed")


class DraftFailure(Exception):
    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


class FailureTally:
    """Thread-safe counts of failed /draft calls by kind, and of all calls."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests = 0
        self.by_kind: collections.Counter[str] = collections.Counter()
        self.last_detail: str | None = None

    def record(self, failure: DraftFailure | None) -> None:
        with self._lock:
            self.requests += 1
            if failure is not None:
                self.by_kind[failure.kind] += 1
                self.last_detail = str(failure)

    @property
    def failures(self) -> int:
        return sum(self.by_kind.values())

    def kinds(self) -> dict[str, int]:
        return {kind: self.by_kind[kind] for kind in FAILURE_KINDS}


def make_client(concurrency: int, timeout_s: float) -> httpx.Client:
    """A pooled client for loopback drafter servers; ignores proxy settings from the environment."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    return httpx.Client(timeout=timeout_s, limits=limits, trust_env=False)


def base_url(url: str) -> str:
    return url.rstrip("/")


def parse_draft(payload, k: int, vocab_size: int | None = None) -> list[int]:
    """The draft in a decoded /draft answer; raises DraftFailure("malformed") if it breaks the protocol."""
    draft = payload.get("draft") if isinstance(payload, dict) else None
    if not isinstance(draft, list):
        raise DraftFailure("malformed", f"no 'draft' list in the answer: {str(payload)[:80]!r}")
    if len(draft) > k:
        raise DraftFailure("malformed", f"{len(draft)} ids drafted, more than k = {k}")
    limit = vocab_size if vocab_size is not None else float("inf")
    for t in draft:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < limit:
            raise DraftFailure("malformed", f"{t!r} is not a token id in [0, {limit})")
    return draft


def fetch_draft(client: httpx.Client, url: str, tokens: list[int], k: int, vocab_size: int | None = None,
                timeout_s: float | None = None) -> list[int]:
    """One /draft call; raises DraftFailure on any breach of the protocol."""
    kwargs = {} if timeout_s is None else {"timeout": timeout_s}
    try:
        response = client.post(f"{base_url(url)}/draft", json={"tokens": tokens, "k": k}, **kwargs)
    except httpx.TimeoutException as exc:
        raise DraftFailure("timeout", type(exc).__name__) from exc
    except httpx.HTTPError as exc:
        raise DraftFailure("error", f"{type(exc).__name__}: {exc}") from exc
    if response.status_code != 200:
        raise DraftFailure("error", f"HTTP {response.status_code}: {response.text[:80]!r}")
    try:
        payload = response.json()
    except ValueError as exc:
        raise DraftFailure("malformed", f"not JSON: {response.text[:80]!r}") from exc
    return parse_draft(payload, k, vocab_size)


def draft_or_empty(client: httpx.Client, url: str, tokens: list[int], k: int, tally: FailureTally,
                   vocab_size: int | None = None, timeout_s: float | None = None) -> list[int]:
    """fetch_draft, with every failure recorded in ``tally`` and scored as the empty draft."""
    try:
        draft = fetch_draft(client, url, tokens, k, vocab_size, timeout_s)
    except DraftFailure as failure:
        tally.record(failure)
        return []
    tally.record(None)
    return draft


def health_status(client: httpx.Client, url: str, timeout_s: float = 5.0) -> int | None:
    """The status of ``GET {url}/health``, or None when the server cannot be reached."""
    try:
        return client.get(f"{base_url(url)}/health", timeout=timeout_s).status_code
    except httpx.HTTPError:
        return None
