"""Decode and verify steps on fixed-shape buffers, captured as CUDA graphs on a GPU.

A step where every sequence feeds at most 33 tokens and reaches its end (decoding: its newest token plus
up to k drafts; a drafter: the few tokens it is behind plus one) is padded to
a (batch, q, context) bucket: q = the most tokens any sequence feeds, batch up the ladder 1, 2, 4, ...,
context up to the next power of two.  Padding rows (and the padding tokens of a sequence with fewer
drafts) write to the cache's scratch block; their logits are dropped.  On a GPU each
(batch, q, context) shape is captured once (lazily, sharing one memory pool) and replayed; on a CPU
the same padded forward runs eagerly, which is how the tests check the padding.

Example: 3 sequences verifying 4, 4 and 2 drafts (q = 5) with 36, 89 and 40 tokens in the cache run
as the (4, 5, 256) graph: rows 0..4, 5..9 and 10..12 are real, rows 13..14 pad the third sequence
(positions 43, 44), rows 15..19 are a padding sequence with context 5 and positions 0..4.  The third
sequence gets context 40 + 5 = 45: its query i still sees exactly the keys at positions <= 40 + i.

With ``compile_backend`` (e.g. "inductor") the padded forward of each shape is compiled with
``torch.compile`` before its graph is captured: elementwise chains fuse into a few Triton kernels, so the
graph replays far fewer launches.  Each shape compiles separately, so this suits a short ladder.
"""

from __future__ import annotations

import torch

from specdec.engine.kv_cache import KVCache, slot_of
from specdec.engine.scheduler import ScheduledSeq
from specdec.models.attention import AttentionBatch
from specdec.models.transformer import CausalLM


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class StaticRunner:
    def __init__(self, model: CausalLM, kv_cache: KVCache, device: torch.device, max_batch: int, max_q: int,
                 max_context: int, capture: bool, compile_backend: str | None = None):
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = kv_cache.block_size
        self.max_batch = _next_power_of_two(max_batch)
        self.max_q = max_q
        self.max_context = _next_power_of_two(max(max_context, 256))
        self.capture = capture and device.type == "cuda"
        rows = self.max_batch * max_q
        max_blocks = -(-self.max_context // self.block_size)
        long = dict(dtype=torch.long, device=device)
        self.ids = torch.zeros(rows, **long)
        self.positions = torch.zeros(rows, **long)
        self.slots = torch.zeros(rows, **long)
        self.context_lens = torch.zeros(self.max_batch, **long)
        self.block_tables = torch.zeros(self.max_batch, max_blocks, **long)
        self.graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.replays = 0
        self.shapes: set[tuple[int, int, int]] = set()  # (batch, q, context) run by precapture()
        self.frozen = False  # after precapture(): other shapes run eagerly instead of capturing mid-serve
        self._padded = self._padded_forward
        if compile_backend:
            self._padded = torch.compile(self._padded_forward, backend=compile_backend, dynamic=False)

    def shape_of(self, seqs: list[ScheduledSeq]) -> tuple[int, int, int]:
        """The (batch, q, context) bucket a step of these sequences is padded to."""
        q = max(s.num_new for s in seqs)
        context = _next_power_of_two(max(max(s.request.num_computed + q for s in seqs), 256))
        return _next_power_of_two(len(seqs)), q, context

    def can_run(self, seqs: list[ScheduledSeq]) -> bool:
        shape = batch, q, context = self.shape_of(seqs)  # max_batch and max_context are powers of two
        if self.frozen and shape not in self.shapes:
            return False  # e.g. a drafter catching up 7 tokens: one eager step beats a capture mid-serve
        return (batch <= self.max_batch and q <= self.max_q and context <= self.max_context
                and all(s.samples and s.request.num_tokens - s.request.num_computed == s.num_new - s.num_drafts
                        for s in seqs))

    @torch.inference_mode()
    def run(self, seqs: list[ScheduledSeq]) -> list[torch.Tensor]:
        """Logits [q, V] per sequence (rows as in ModelRunner.forward)."""
        batch, q, context = self.shape_of(seqs)
        self._fill(seqs, q, batch)
        logits = self._forward(batch, q, context)  # [batch * q, V]
        # the rows the sampler reads: after the last fed token and after each draft (see ModelRunner.forward);
        # a short prefill feeds several prompt tokens but samples only after the last one
        return [logits[i * q + s.num_new - 1 - s.num_drafts:i * q + s.num_new] for i, s in enumerate(seqs)]

    def precapture(self, qs: list[int]) -> int:
        """Capture (on a CPU: run) every (batch, q, context) shape for the given q values up front, largest
        batch first, so that no served step pays for a capture; afterwards other shapes run eagerly
        (``frozen``).  Returns the number of shapes."""
        batches = [1 << i for i in range(self.max_batch.bit_length())]
        contexts = [c for c in (256 << i for i in range(20)) if c <= self.max_context]
        shapes = [(b, q, c) for q in sorted(set(qs)) if 1 <= q <= self.max_q
                  for b in reversed(batches) for c in contexts]
        for batch, q, context in shapes:
            self._fill([], q, batch)  # padding rows only: scratch slots, no real sequence is touched
            self._forward(batch, q, context)
        self.shapes.update(shapes)
        self.frozen = True
        return len(shapes)

    def _fill(self, seqs: list[ScheduledSeq], q: int, batch: int) -> None:
        ids, positions, slots, ctx, tables = [], [], [], [], []
        scratch = self.kv_cache.scratch_block
        width = self.block_tables.shape[1]
        for seq in seqs:
            req = seq.request
            start, extra = req.num_computed, q - seq.num_new
            fed = req.all_token_ids[start:start + seq.num_new - seq.num_drafts]
            ids += fed + req.draft_token_ids[:seq.num_drafts] + [0] * extra
            positions += range(start, start + q)
            slots += [slot_of(req.block_ids, p, self.block_size)
                      for p in range(start, start + seq.num_new)]
            slots += [scratch * self.block_size + i % self.block_size for i in range(extra)]
            ctx.append(start + q)
            tables.append(req.block_ids + [scratch] * (width - len(req.block_ids)))
        pad = batch - len(seqs)
        ids += [0] * (pad * q)
        positions += list(range(q)) * pad
        slots += [scratch * self.block_size + i % self.block_size for i in range(pad * q)]
        ctx += [q] * pad
        tables += [[scratch] * width] * pad
        rows = batch * q
        self.ids[:rows].copy_(torch.tensor(ids), non_blocking=True)
        self.positions[:rows].copy_(torch.tensor(positions), non_blocking=True)
        self.slots[:rows].copy_(torch.tensor(slots), non_blocking=True)
        self.context_lens[:batch].copy_(torch.tensor(ctx), non_blocking=True)
        self.block_tables[:batch].copy_(torch.tensor(tables), non_blocking=True)

    def _forward(self, batch: int, q: int, context: int) -> torch.Tensor:
        if not self.capture:
            return self._eager(batch, q, context)
        key = (batch, q, context)
        if key not in self.graphs:
            self.graphs[key] = self._capture(batch, q, context)
        graph, out = self.graphs[key]
        graph.replay()
        self.replays += 1
        return out

    def _eager(self, batch: int, q: int, context: int) -> torch.Tensor:
        """The padded forward: logits [batch * q, V] for every row, padding included."""
        return self._padded(batch, q, context)

    def _padded_forward(self, batch: int, q: int, context: int) -> torch.Tensor:
        rows = batch * q
        attn = AttentionBatch(
            query_start=torch.arange(0, rows + 1, q, device=self.device),
            context_lens=self.context_lens[:batch],
            block_tables=self.block_tables[:batch, :-(-context // self.block_size)],
            slot_mapping=self.slots[:rows],
            max_query_len=q,
            max_context_len=context,
            uniform=True,
        ).prepare(self.block_size)
        return self.model(self.ids[:rows], self.positions[:rows], attn, self.kv_cache.layers)

    def _capture(self, batch: int, q: int, context: int):
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the graph (allocator, kernels' lazy init)
                self._eager(batch, q, context)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._eager(batch, q, context)
        return graph, out
