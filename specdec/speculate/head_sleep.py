"""An EAGLE-3 / MTP head asleep while its controller plans k = 0: it keeps each plain step's feature rows and
feeds them in one forward when it next drafts (or when a request has kept `kept_limit` positions: by default
the widest observe its graphs hold, so that the forward replays one).

Where speculation does not pay (k = 0: a busy engine, a head that is rarely accepted), observing every step
costs a head forward each: fc over the target's features and one decoder layer, its weights read from memory
for one position a sequence (docs/BENCHMARKS.md measures it against a plain step).  Asleep, a step without drafts only copies its feature rows, [B, F], aside.  The head's
KV cache then holds positions < state.computed and the request's kept rows cover computed .. computed +
len(pending) - 1, in order; the next forward over them (wake) writes their keys and leaves the head exactly
as observing each step would have (the same positions, tokens and features, batched).

Example: a request's head holds 0..9 (computed 10); steps without drafts feed positions 10, 11, 12 and keep
their rows; the next propose that drafts for it feeds positions 10..12 with tokens 11..13 in one forward, and
its output at 12 gives draft 1, as it would after three observes.

Which rows sleep: a step's plain decode rows (one fed token) where no sequence of the step has drafts.  A row
of a step that drafts, or of a prefill, wakes its request first (its kept rows lead the row), so the head never
misses a position; a row whose position does not follow the kept ones (a request recomputed after preemption)
drops them.  `HeadSleep` is a part of Eagle3Speculator, reading its head, states and stats.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from specdec.engine.request import Request
from specdec.engine.scheduler import ScheduledSeq


class KeptAhead(NamedTuple):
    """A step without drafts launched before the host read it (observe_ahead): its feature rows, copied."""

    seqs: list[ScheduledSeq]  # the step's sequences (the list itself: observe settles only that step)
    starts: list[int]  # seqs[i]'s fed position
    features: torch.Tensor  # [B, F] seqs[i]'s row i


class HeadSleep:
    """The sleeping part of Eagle3Speculator: keep rows (sleep), feed them (wake)."""

    DEFAULT_LIMIT = 8  # kept positions a request feeds at once, without head graphs (a CPU)

    def _init_sleep(self) -> None:
        # positions a request may keep before they are fed anyway; 0: observe every step; None: the widest
        # observe the head's graphs captured (8 for k <= 7), so that every wake and catch-up replays a graph
        # (an eager head forward costs more than the observes it replaces: docs/BENCHMARKS.md)
        self.defer_limit: int | None = None

    @property
    def kept_limit(self) -> int:
        """defer_limit resolved: None -> the head graphs' widest captured q (DEFAULT_LIMIT before precapture)."""
        if self.defer_limit is not None:
            return self.defer_limit
        ladder = self.graphs.q_ladder if self.graphs is not None else []
        return max(2, ladder[-1]) if ladder else self.DEFAULT_LIMIT

    def _sleeps(self, seqs: list[ScheduledSeq]) -> bool:
        """Whether this step's plain decode rows are kept rather than fed: no sequence of it has drafts."""
        return self.kept_limit > 0 and not any(seq.num_drafts for seq in seqs)

    def _keep_ahead(self, seqs: list[ScheduledSeq], starts: list[int], runner) -> KeptAhead:
        """observe_ahead of a step without drafts: copy its feature rows aside before a later forward overwrites
        them (one copy; the ids follow from the commit)."""
        features = torch.cat([runner.step_features(i, 1) for i in range(len(seqs))])  # [B, F]
        return KeptAhead(seqs, list(starts), features)

    def _settle_kept(self, kept: KeptAhead) -> None:
        """After the commit of a step kept ahead: each live request keeps its row (or is fed, _sleep_or_wake)."""
        rows = []
        for row, (seq, start) in enumerate(zip(kept.seqs, kept.starts)):
            req = seq.request
            if not req.finished and req.num_computed == start + 1 and start + 1 <= self.max_positions:
                rows.append((req, start, 1, req.token_ids_between(start + 1, start + 2),
                             kept.features[row:row + 1]))
        self._feed(self._sleep_or_wake(rows, sleep=True, owned=True), with_logits=False)

    def _sleep_or_wake(self, rows: list, sleep: bool, owned: bool = False) -> list:
        """rows: (request, first position, count, ids, features [count, F]) of a step's committed positions.
        Keeps the plain decode rows where `sleep` (copying their features unless `owned`) and returns the rows
        to feed now: the others, each led by its request's kept rows (_kept_row), and any request's kept rows that reached
        kept_limit."""
        feed, keep = [], []
        for row in rows:
            req, start, count = row[0], row[1], row[2]
            state = self._state(req)
            if state.pending and start != state.computed + len(state.pending):
                state.pending = []  # recomputed after preemption: the kept rows are stale
            if sleep and count == 1 and start == state.computed + len(state.pending):
                keep.append(row)
            else:
                feed.append(self._kept_row(req, then=row) if state.pending else row)
        if keep:
            copies = torch.cat([row[4] for row in keep]) if not owned else None  # one copy for the step
            for i, row in enumerate(keep):
                state = self._state(row[0])
                state.pending.append(row[4] if owned else copies[i:i + 1])
                self.stats["head_positions_kept"] += 1
                if len(state.pending) >= self.kept_limit:
                    feed.append(self._kept_row(row[0]))
        return feed

    def _kept_row(self, req: Request, then: tuple | None = None) -> tuple:
        """A row of the request's kept positions (they are then no longer kept), followed by those of `then`, a
        row that starts where they end, if given."""
        state = self._state(req)
        first, features, state.pending = state.computed, state.pending, []
        end = first + len(features)
        if then is not None:
            end, features = then[1] + then[2], features + [then[4]]
        return (req, first, end - first, req.token_ids_between(first + 1, end + 1), torch.cat(features))

    def _wake(self, requests: list[Request]) -> None:
        """Feed the kept rows of these requests (about to draft) in one forward, with logits for their chains."""
        rows = [self._kept_row(req) for req in requests
                if req.request_id in self.states and self.states[req.request_id].pending]
        if rows:
            self.stats["head_wakes"] += 1
            self._feed(rows, with_logits=True)

    def _keeps_any(self, seqs: list[ScheduledSeq]) -> bool:
        """Whether a request of these sequences keeps rows (its step must then be fed after the commit)."""
        return any(self.states[s.request.request_id].pending for s in seqs if s.request.request_id in self.states)
