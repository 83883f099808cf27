"""The recurrent-state slots of a hybrid model's linear-attention layers (Qwen3.5), beside the paged KV cache.

Each running request owns one slot of the pools (models/recurrent_state.py): taken when it is first fed,
zeroed whenever it is fed from position 0 (a new request, or one preempted and now recomputed from scratch),
released when it finishes or is preempted.  A verify step defers the slots of the sequences with drafts and
`commit` then advances each by exactly the tokens it kept, so a rejected draft leaves no trace in the state.

Prefix caching is off for hybrid models: a cached block holds keys and values, not the recurrent state after
its tokens, so a hit could not resume the linear layers.
"""

from __future__ import annotations

import torch

from specdec.engine.request import Request
from specdec.engine.scheduler import ScheduledSeq
from specdec.models.config import ModelConfig
from specdec.models.recurrent_state import StateBatch, commit, new_state_pools


class StateSlots:
    def __init__(self, config: ModelConfig, num_slots: int, device: torch.device, dtype: torch.dtype):
        self.conv, self.ssm = new_state_pools(config, num_slots + 1, device, dtype)
        self.free = list(range(num_slots, -1, -1))  # slot num_slots: a scoring pass's (all_logits)
        self.last: StateBatch | None = None  # the last forward's, for commit

    def batch(self, seqs: list[ScheduledSeq]) -> StateBatch:
        """The StateBatch of a step: each sequence's slot (taken, and zeroed when it starts from position 0);
        sequences verifying drafts are deferred."""
        for seq in seqs:
            req = seq.request
            if req.state_slot is None:
                req.state_slot = self.take()
            if req.num_computed == 0:
                self.zero(req.state_slot)
        self.last = StateBatch(self.conv, self.ssm, slots=[s.request.state_slot for s in seqs],
                               defer=[s.num_drafts > 0 for s in seqs])
        return self.last

    def commit(self, kept: list[int]) -> None:
        """After a verify step: deferred sequence i keeps its first kept[i] fed tokens (its committed tokens and
        accepted drafts)."""
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
