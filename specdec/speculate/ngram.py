"""Prompt-lookup drafting: continue the longest suffix of the context that occurred earlier in it."""

from __future__ import annotations

import numpy as np

from specdec.engine.request import Request
from specdec.speculate.base import Speculator


def ngram_draft(tokens: list[int] | np.ndarray, k: int, max_n: int = 4, min_n: int = 1,
                stop_ids: set[int] | frozenset = frozenset()) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest matching suffix.

    Example: tokens = [a b c d a b], max_n 4 -> suffix [a b] occurred at 0, followed by [c d a b],
    so k = 3 drafts [c d a].  The draft is cut after the first stop id (no token past an EOS).

    One pass over the context finds the earlier copies of the last token (the candidate match ends);
    each candidate's match is then extended backwards, at most max_n - 1 more comparisons per candidate.
    """
    arr = np.asarray(tokens, dtype=np.int64)
    length = len(arr)
    longest = min(max_n, length - 1)  # a suffix needs an earlier occurrence that leaves a continuation
    if k <= 0 or longest < max(1, min_n):
        return []
    ends = np.flatnonzero(arr[:length - 1] == arr[length - 1])  # [C] where a match of the suffix may end
    matched = np.ones(len(ends), dtype=np.int64)  # [C] how many suffix tokens each candidate matches
    for j in range(1, longest):
        alive = (matched == j) & (ends >= j)  # still matching, and room for one more token before it
        if not alive.any():
            break
        alive[alive] = arr[ends[alive] - j] == arr[length - 1 - j]
        matched[alive] += 1
    if not len(ends) or matched.max() < min_n:
        return []
    best = matched.max()
    start = int(ends[np.flatnonzero(matched == best)[-1]]) + 1  # the most recent of the longest matches
    draft = arr[start:start + k].tolist()
    for i, t in enumerate(draft):
        if t in stop_ids:
            return draft[:i + 1]
    return draft


class TokenArrays:
    """Each request's tokens as a growing numpy array, appended to as the request grows (tokens of a request
    are only ever appended), so a lookup does not convert the whole context every step."""

    def __init__(self):
        self.arrays: dict[str, tuple[np.ndarray, int]] = {}  # request id -> (buffer, tokens in it)

    def of(self, req: Request) -> np.ndarray:
        buffer, count = self.arrays.get(req.request_id, (np.empty(0, dtype=np.int64), 0))
        total = req.num_tokens
        if total > len(buffer):
            grown = np.empty(max(2 * len(buffer), total, 256), dtype=np.int64)
            grown[:count] = buffer[:count]
            buffer = grown
        if total > count:
            buffer[count:total] = req.token_ids_between(count, total)
        self.arrays[req.request_id] = (buffer, total)
        return buffer[:total]

    def drop(self, request_id: str) -> None:
        self.arrays.pop(request_id, None)


class NgramSpeculator(Speculator):
    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n
        self.tokens = TokenArrays()

    def propose(self, requests: list[Request], ks: list[int]) -> None:
        for req, k in zip(requests, ks):
            req.draft_token_ids = (ngram_draft(self.tokens.of(req), k, self.max_n, self.min_n, req.stop_ids)
                                   if k else [])
            req.draft_probs = None

    def release(self, request: Request) -> None:
        self.tokens.drop(request.request_id)
