"""Prompt-lookup drafting: continue the longest suffix of the context that occurred earlier in it."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from specdec.engine.request import Request
from specdec.speculate.base import Speculator


def ngram_draft(tokens: list[int] | np.ndarray, k: int, max_n: int = 4, min_n: int = 1,
                stop_ids: set[int] | frozenset = frozenset()) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest matching suffix.

    Example: tokens = [a b c d a b], max_n 4 -> suffix [a b] occurred at 0, followed by [c d a b],
    so k = 3 drafts [c d a].  The draft is cut after the first stop id (no token past an EOS).
    """
    arr = np.asarray(tokens, dtype=np.int64)
    length = len(arr)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = sliding_window_view(arr[:length - 1], n)  # [length - n, n]: starts that leave a continuation
        hits = np.flatnonzero((windows == arr[length - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            draft = arr[start:start + k].tolist()
            for i, t in enumerate(draft):
                if t in stop_ids:
                    return draft[:i + 1]
            return draft
    return []


class NgramSpeculator(Speculator):
    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n

    def propose(self, requests: list[Request], ks: list[int]) -> None:
        for req, k in zip(requests, ks):
            req.draft_token_ids = ngram_draft(req.all_token_ids, k, self.max_n, self.min_n, req.stop_ids) if k else []
            req.draft_probs = None
