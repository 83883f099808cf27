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


def ngram_draft_batch(contexts: list[np.ndarray], ks: list[int], max_n: int = 4, min_n: int = 1,
                      stop_ids: list[set[int] | frozenset] | None = None) -> list[list[int]]:
    """ngram_draft for every context at once: one numpy pass over all of them.

    Per request, ngram_draft makes ~15 small numpy calls; at 64 requests that was 2 ms a step on the H200's
    host, as much as the verify step itself.  Here the contexts are laid end to end (flat [N], owner [N]):

        candidates  positions p, not the last of their context, whose token equals their context's last token
        matched     for each candidate, how many tokens j = 0 .. longest - 1 back from p equal the suffix's,
                    counting only while they do (a cumulative product) and while p - j stays in the context
        best        per context, the candidate with the most matched tokens, the latest among equals
                    (score = matched * N + p, its maximum per owner)

    Example: contexts [a b c a b] and [x y]: the first's candidates are its position 1 (b); 2 tokens match
    ([a b]), so the draft is what follows position 1: [c a b][:k].  The second has no candidate: [].
    """
    stop_ids = stop_ids or [frozenset()] * len(contexts)
    drafts: list[list[int]] = [[] for _ in contexts]
    lengths = np.fromiter((len(c) for c in contexts), np.int64, len(contexts))  # [R]
    if not len(contexts) or lengths.sum() == 0:
        return drafts
    flat = np.concatenate(contexts).astype(np.int64, copy=False)  # [N]
    size = len(flat)
    starts = np.cumsum(lengths) - lengths  # [R] where each context begins in flat
    last = starts + lengths - 1  # [R] each context's last position (starts - 1 for an empty one)
    owner = np.repeat(np.arange(len(contexts)), lengths)  # [N]
    longest = np.minimum(max_n, lengths - 1)  # [R] the longest suffix that can have an earlier occurrence
    is_last = np.zeros(size, dtype=bool)
    is_last[last[lengths > 0]] = True
    ends = np.flatnonzero((flat == flat[last[owner]]) & ~is_last)  # [C] candidate ends of a suffix match
    if not len(ends):
        return drafts
    who = owner[ends]  # [C]
    back = np.arange(max_n)  # [n]
    window = ends[:, None] - back  # [C, n] the candidate's tokens, going back
    suffix = last[who][:, None] - back  # [C, n] the suffix's tokens, going back
    inside = (window >= starts[who][:, None]) & (back < longest[who][:, None])
    same = inside & (flat[np.maximum(window, 0)] == flat[np.maximum(suffix, 0)])
    matched = np.cumprod(same, axis=1).sum(axis=1)  # [C]
    best = np.full(len(contexts), -1, dtype=np.int64)
    np.maximum.at(best, who, matched * size + ends)
    for r in np.flatnonzero(best >= 0).tolist():
        if ks[r] <= 0 or best[r] // size < max(1, min_n):
            continue
        begin = int(best[r] % size) + 1
        draft = flat[begin:min(begin + ks[r], last[r] + 1)].tolist()
        cut = next((i + 1 for i, t in enumerate(draft) if t in stop_ids[r]), len(draft))
        drafts[r] = draft[:cut]
    return drafts


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

    BATCH_FROM = 4  # requests: below, one lookup each is cheaper (36 us against 69 us for one request on CPU)

    def propose(self, requests: list[Request], ks: list[int]) -> None:
        asked = [(req, k) for req, k in zip(requests, ks) if k > 0]
        contexts = [self.tokens.of(req) for req, _ in asked]
        if len(asked) < self.BATCH_FROM:
            drafts = [ngram_draft(c, k, self.max_n, self.min_n, req.stop_ids) for c, (req, k) in zip(contexts, asked)]
        else:
            drafts = ngram_draft_batch(contexts, [k for _, k in asked], self.max_n, self.min_n,
                                       [req.stop_ids for req, _ in asked])
        for req in requests:
            req.clear_drafts()
        for (req, _), draft in zip(asked, drafts):
            req.draft_token_ids = draft

    def release(self, request: Request) -> None:
        self.tokens.drop(request.request_id)
