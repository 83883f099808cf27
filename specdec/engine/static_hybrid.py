"""Fixed-shape (CUDA graph) decode and verify steps of a hybrid model (Qwen3.5): the recurrent state in them.

StaticRunner pads a step to a (batch, q, context) bucket.  A hybrid model's linear layers also read and write
each sequence's recurrent-state slot (engine/state_slots.py), so here the step stages the slots too, after
its other inputs in the same copy (padding sequences get the pools' scratch slot), and the model's linear
layers take the whole padded step as one group (models/gated_deltanet.uniform_group), without a host read.

Padding rows would advance a state through tokens that are not there, so a step of q > 1 defers every
sequence (its slots are only read) and copies what the commit needs into a RecordArena; after sampling,
`commit` stages each sequence's kept count and replays the shape's commit graph, which advances every slot by
exactly its count (models/recurrent_state.commit_on_device).  Example: q = 3, sequence 0 verified 2 drafts and
kept 1 (count 2), sequence 1 fed 1 token (count 1), a padding sequence (count 0): the graph replays up to 3
tokens per slot, each past its count masked.  A step of q = 1 (plain decoding) writes the states back itself.

Graphs are captured on padding only (scratch slots, as precapture stages them) even when a shape first runs
mid-serve, so a capture's warm-up forwards never advance a real sequence's state.
"""

from __future__ import annotations

import torch

from specdec.engine.kv_cache import KVCache
from specdec.engine.scheduler import ScheduledSeq
from specdec.engine.state_slots import StateSlots
from specdec.engine.graph_warm_up import warm_up
from specdec.engine.static_runner import StaticRunner, _input_size
from specdec.models.attention import AttentionBatch
from specdec.models.recurrent_state import RecordArena, StateBatch, commit_on_device
from specdec.transfer import upload


class HybridStaticRunner(StaticRunner):
    def __init__(self, model, kv_cache: KVCache, device: torch.device, max_batch: int, max_q: int,
                 max_context: int, capture: bool, state_slots: StateSlots):
        super().__init__(model, kv_cache, device, max_batch, max_q, max_context, capture)
        self.state_slots = state_slots
        self.arena = RecordArena()
        self.counts = torch.zeros(self.max_batch, dtype=torch.long, device=device)  # the commit's, staged
        self.step_states: StateBatch | None = None  # the last padded forward's (its records, when deferred)
        # per captured (batch, q, context) of q > 1: the records its graph writes, and its commit graph
        self.records: dict[tuple[int, int, int], StateBatch] = {}
        self.commit_graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}

    def _extra(self, seqs: list[ScheduledSeq], batch: int) -> list[int]:
        """The slots [batch]: each sequence's (taken, zeroed at position 0), then the scratch slot."""
        slots = self.state_slots.assign(seqs)
        return slots + [self.state_slots.scratch] * (batch - len(slots))

    def _call(self, ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBatch, rows: int) -> torch.Tensor:
        batch, q = attn.context_lens.shape[0], attn.max_query_len
        start = _input_size(batch, q, attn.block_tables.shape[1])  # the slots follow the step's inputs
        attn.states = self.step_states = StateBatch(
            self.state_slots.conv, self.state_slots.ssm, slots=self.inputs[start:start + batch],
            defer=[q > 1] * batch, arena=self.arena)
        return super()._call(ids, positions, attn, rows)

    def _forward(self, batch: int, q: int, context: int) -> torch.Tensor:
        logits = super()._forward(batch, q, context)
        self.state_slots.last = None
        if q == 1:  # the states were written back by the forward
            self.state_slots.pending_commit = None
        else:
            records = self.records[(batch, q, context)] if self.capture else self.step_states
            self.state_slots.pending_commit = lambda kept: self._commit(records, (batch, q, context), kept)
        return logits

    def _commit(self, records: StateBatch, shape: tuple[int, int, int], kept: list[int]) -> None:
        """Advance the step's slots by kept[i] tokens each (padding sequences by none)."""
        batch = shape[0]
        self.counts[:batch].copy_(upload(kept + [0] * (batch - len(kept)), self.device))
        if self.capture:
            self.commit_graphs[shape].replay()
        else:
            commit_on_device(records, self.counts[:batch])

    def _capture(self, batch: int, q: int, context: int):
        """The forward's graph (and for q > 1 the commit's), captured on a step of padding only; the step
        staged before is staged again afterwards."""
        staged = self.inputs.clone()
        self._stage([], q, batch, context, extra=self._extra([], batch))
        captured = super()._capture(batch, q, context)
        if q > 1:
            shape = (batch, q, context)
            self.records[shape] = self.step_states  # its tensors: the arena's, rewritten at every replay
            self.counts.zero_()
            self.commit_graphs[shape] = self._capture_commit(self.step_states, batch)
        self.inputs.copy_(staged)
        return captured

    def _capture_commit(self, records: StateBatch, batch: int) -> torch.cuda.CUDAGraph:
        # warm-up: counts are 0 and every slot is the scratch one
        warm_up(self.device, lambda: commit_on_device(records, self.counts[:batch]), times=1)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            commit_on_device(records, self.counts[:batch])
        return graph
