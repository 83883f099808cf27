"""The recurrent-state slots of a hybrid model's linear-attention layers (Qwen3.5), beside the paged KV cache.

Each running request owns one slot of the pools (models/recurrent_state.py): taken when it is first fed,
zeroed whenever it is fed from position 0 (a new request, or one preempted and now recomputed from scratch),
released when it finishes or is preempted.  A verify step defers the slots of the sequences with drafts and
`commit` then advances each by exactly the tokens it kept, so a rejected draft leaves no trace in the state.
A fixed-shape (CUDA graph) step assigns its slots here too and sets the commit it needs
(engine/static_hybrid.py); padding sequences use the scratch slot, which no request ever owns.

Prefix caching is off for hybrid models: a cached block holds keys and values, not the recurrent state after
its tokens, so a hit could not resume the linear layers.
"""

from __future__ import annotations

from typing import Callable

import torch

from specdec.engine.request import Request
from specdec.engine.scheduler import ScheduledSeq
from specdec.models.config import ModelConfig
from specdec.models.recurrent_state import StateBatch, commit, new_state_pools


class StateSlots:
    def __init__(self, config: ModelConfig, num_slots: int, device: torch.device, dtype: torch.dtype):
        self.conv, self.ssm = new_state_pools(config, num_slots + 2, device, dtype)
        self.free = list(range(num_slots, -1, -1))  # slot num_slots: a scoring pass's (all_logits)
        self.scratch = num_slots + 1  # the padding sequences' of fixed-shape steps: never a request's
        self.last: StateBatch | None = None  # the last eager forward's, for commit
        # what commit() runs after the last forward: the eager commit, a fixed-shape step's, or nothing
        self.pending_commit: Callable[[list[int]], None] | None = None

    def assign(self, seqs: list[ScheduledSeq]) -> list[int]:
        """Each sequence's slot: taken at its first step, and zeroed whenever it is fed from position 0."""
        for seq in seqs:
            req = seq.request
            if req.state_slot is None:
                req.state_slot = self.take()
            if req.num_computed == 0:
                self.zero(req.state_slot)
        return [s.request.state_slot for s in seqs]

    def batch(self, seqs: list[ScheduledSeq]) -> StateBatch:
        """The StateBatch of an eager step (its slots assigned); sequences verifying drafts are deferred."""
        self.last = StateBatch(self.conv, self.ssm, slots=self.assign(seqs), defer=[s.num_drafts > 0 for s in seqs])
        self.pending_commit = self._commit_last
        return self.last

    def commit(self, kept: list[int]) -> None:
        """After a verify step: deferred sequence i keeps its first kept[i] fed tokens (its committed tokens and
        accepted drafts)."""
        run, self.pending_commit = self.pending_commit, None
        if run is not None:
            run(kept)

    def _commit_last(self, kept: list[int]) -> None:
        if self.last is not None and self.last.pending:
            commit(self.last, kept)
        self.last = None

    def take(self) -> int:
        if not self.free:
            raise RuntimeError("no recurrent-state slot is free: more sequences run than the engine sized for")
        return self.free.pop()

    def zero(self, slot: int) -> None:
        for pool in (*self.conv, *self.ssm):
            pool[slot].zero_()

    def release(self, req: Request) -> None:
        if req.state_slot is not None:
            self.free.append(req.state_slot)
            req.state_slot = None
