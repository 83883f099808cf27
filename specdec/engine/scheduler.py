"""Continuous batching: which requests run this step, with how many tokens each.

Every step has a token budget.  Running requests go first, oldest first; each feeds its uncomputed
tokens (one while decoding; a chunk of its prompt while prefilling).  Then each decoding request's drafts
join, in the same order, as far as the budget and blocks already free allow.  Waiting requests are admitted
oldest first while budget, sequence slots and cache blocks remain.
When a running request needs a block and none is free, blocks other running requests hold beyond their
tokens (a drafter's lookahead: an EAGLE-3 head's chain takes them in propose) are taken back first; then the
newest running request is preempted: its blocks are released and it is recomputed from scratch later (its
tokens so far become prompt).  Drafts never preempt anyone: under a nearly full cache, speculation must
not turn decoding into recomputation.

Admissions can be coalesced (`admission_batch`): a step that prefills runs eagerly, and on a GPU an eager
step costs many graph-replayed decode steps, so admitting each request in the step its slot frees up turns
staggered finishes (speculation makes every reply end at its own step) into a string of eager steps.  While
requests are decoding, waiting ones are then admitted once `admission_batch` slots are free (or all of them
fit), after at most `admission_max_wait` held steps, or at once when the step prefills anyway.  The engine
sizes the batch from measured step costs (engine/admission.py).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Iterable

from specdec.draft_tree import depths
from specdec.engine.kv_cache import BlockManager
from specdec.engine.request import Request, Status


@dataclasses.dataclass
class ScheduledSeq:
    request: Request
    num_new: int  # tokens fed this step, drafts included
    num_drafts: int  # drafts among them (the last num_drafts tokens)
    samples: bool  # the step reaches the sequence's end, so new tokens are sampled

    @property
    def tree_parents(self) -> list[int] | None:
        """The parents of the drafts this step verifies when they form a tree (specdec/draft_tree.py), else None."""
        parents = self.request.draft_parents
        return parents[:self.num_drafts] if parents is not None and self.num_drafts else None

    @property
    def draft_depth(self) -> int:
        """How many drafts deep the step verifies: the drafts of a chain, the deepest node of a tree."""
        parents = self.tree_parents
        return max(depths(parents)) if parents is not None else self.num_drafts


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_batched_tokens: int, max_num_seqs: int,
                 admission_batch: int = 1, admission_max_wait: int = 64):
        self.blocks = blocks
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.admission_batch = admission_batch
        self.admission_max_wait = admission_max_wait
        self.held_steps = 0  # consecutive steps that held waiting requests back for a fuller admission
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.out_of_cache: list[Request] = []  # finished because even alone they outgrew the cache
        self.on_release = None  # called with a request that leaves the running set (finished or preempted)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            seq = self._plan(req, budget)
            if not self._grow(req, req.num_computed + seq.num_new):
                continue  # req itself was preempted (it was the newest); self.running shrank
            scheduled.append(seq)
            budget -= seq.num_new
            i += 1
        budget = self._add_drafts(scheduled, budget)
        if len(scheduled) == len(self.running) and self._admission_due(scheduled):  # nobody left out
            budget = self._admit(scheduled, budget)
        return scheduled

    def admission_open(self, prefills: bool) -> bool:
        """Whether waiting requests may join a step in which running requests prefill (`prefills`: it runs
        eagerly anyway) or not: the module's note on coalescing.  False when nobody waits or no slot is free."""
        free = self.max_num_seqs - len(self.running)
        if not self.waiting or free == 0:
            return False
        return (not self.running or prefills or free >= min(self.admission_batch, len(self.waiting))
                or self.held_steps >= self.admission_max_wait)

    def joining(self, prefills: bool) -> Iterable[Request]:
        """The waiting requests that would join such a step: the queue's head, as many as slots are free."""
        if not self.admission_open(prefills):
            return ()
        return itertools.islice(self.waiting, self.max_num_seqs - len(self.running))

    def _admission_due(self, scheduled: list[ScheduledSeq]) -> bool:
        """Whether waiting requests are admitted this step (called once per step, with every running request
        scheduled); counts the steps that held them back."""
        prefills = any(s.num_new - s.num_drafts > 1 for s in scheduled)
        if self.admission_open(prefills):
            self.held_steps = 0
            return True
        held = self.waiting and len(self.running) < self.max_num_seqs  # someone could have joined
        self.held_steps = self.held_steps + 1 if held else 0
        return False

    def finish(self, request: Request) -> None:
        """Release a finished request's blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.blocks.release(request.block_ids)
        request.block_ids = []
        self._released(request)

    def _released(self, request: Request) -> None:
        if self.on_release is not None:
            self.on_release(request)

    # ------------------------------------------------------------------

    def _plan(self, req: Request, budget: int) -> ScheduledSeq:
        """The request's uncomputed tokens this step, drafts left to _add_drafts."""
        remaining = req.num_tokens - req.num_computed
        if remaining > budget:  # chunked prefill: no sampling this step, drafts wait
            return ScheduledSeq(req, budget, 0, samples=False)
        return ScheduledSeq(req, remaining, 0, samples=True)

    def _add_drafts(self, scheduled: list[ScheduledSeq], budget: int) -> int:
        """Each sampling sequence's drafts (a prefix of them: a tree's layout keeps parents first) as far as the
        budget and the blocks it holds or that are free allow, never preempting; returns the budget left."""
        size = self.blocks.block_size
        for i, seq in enumerate(scheduled):
            req = seq.request
            if not seq.samples or not req.draft_token_ids or budget <= 0:
                continue
            end = req.num_computed + seq.num_new  # the first draft's position
            room = (len(req.block_ids) + self.blocks.num_free) * size - end
            drafts = min(len(req.draft_token_ids), budget, room)
            if drafts <= 0:
                continue
            need = self.blocks.blocks_for(end + drafts) - len(req.block_ids)
            if need > 0:
                req.block_ids.extend(self.blocks.allocate(need))  # free: room counted them
            scheduled[i] = ScheduledSeq(req, seq.num_new + drafts, drafts, samples=True)
            budget -= drafts
        return budget

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Give req blocks for num_tokens: from the free ones, then from other requests' lookahead blocks, then
        by preempting the newest running requests."""
        need = self.blocks.blocks_for(num_tokens) - len(req.block_ids)
        while need > 0:
            new = self.blocks.allocate(need)
            if new is not None:
                req.block_ids.extend(new)
                return True
            if self._reclaim_lookahead(req):
                continue
            victim = self.running[-1]
            if victim is req and len(self.running) == 1:  # alone and still too big: the cache is full
                self.finish(req)
                req.finish("length")
                self.out_of_cache.append(req)
                return False
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _reclaim_lookahead(self, asking: Request) -> bool:
        """Release the blocks other running requests hold beyond their tokens (what a drafter took for drafts
        not yet verified); returns whether any were freed."""
        freed = False
        for other in self.running:
            keep = self.blocks.blocks_for(other.num_tokens)
            if other is not asking and len(other.block_ids) > keep:
                self.blocks.release(other.block_ids[keep:])
                del other.block_ids[keep:]
                freed = True
        return freed

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.blocks.release(req.block_ids)
        req.block_ids = []
        self._released(req)
        req.num_computed = 0
        req.clear_drafts()
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _admit(self, scheduled: list[ScheduledSeq], budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            cached, hashes = self.blocks.cached_prefix(req.all_token_ids)
            self.blocks.acquire(cached)
            uncached = req.num_tokens - len(cached) * self.blocks.block_size
            chunk = min(uncached, budget)
            need = self.blocks.blocks_for(len(cached) * self.blocks.block_size + chunk) - len(cached)
            fresh = self.blocks.allocate(need)
            if fresh is None:  # FIFO: nobody overtakes the oldest waiting request
                self.blocks.release(cached)
                break
            self.waiting.popleft()
            req.block_ids = cached + fresh
            req.block_hashes = hashes
            req.num_computed = len(cached) * self.blocks.block_size
            req.num_cached_prefix = req.num_computed
            req.status = Status.RUNNING
            self.running.append(req)
            scheduled.append(ScheduledSeq(req, chunk, 0, samples=chunk == uncached))
            budget -= chunk
        return budget
