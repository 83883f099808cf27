"""Decode and verify steps on fixed-shape buffers, captured as CUDA graphs on a GPU.

A step where every sequence feeds at most 33 tokens and reaches its end (decoding: its newest token plus
up to k drafts; a drafter: the few tokens it is behind plus one) is padded to
a (batch, q, context) bucket: q = the most tokens any sequence feeds (after start-up capture, rounded up
to a captured q), batch up the ladder 1, 2, 4, ...,
context up to the next power of two.  Padding rows (and the padding tokens of a sequence with fewer
drafts) write to the cache's scratch block; their logits are dropped.  On a GPU each
(batch, q, context) shape is captured once (lazily, sharing one memory pool) and replayed; on a CPU
the same padded forward runs eagerly, which is how the tests check the padding.

Example: 3 sequences verifying 4, 4 and 2 drafts (q = 5) with 36, 89 and 40 tokens in the cache run
as the (4, 5, 256) graph: rows 0..4, 5..9 and 10..12 are real, rows 13..14 pad the third sequence
(positions 43, 44), rows 15..19 are a padding sequence with context 5 and positions 0..4.  The third
sequence gets context 40 + 5 = 45: its query i still sees exactly the keys at positions <= 40 + i.

Draft trees (`enable_tree_masks`, when the speculator drafts trees): every step of q > 1 also stages a
[batch, q, q] mask (specdec/draft_tree.py; causal rows for chains and padding) after its inputs, and a tree's
nodes take the root's position plus their depth, while their slots stay in fed order.

With ``compile_backend`` (e.g. "inductor") the padded forward of each shape is compiled with
``torch.compile`` before its graph is captured: elementwise chains fuse into a few Triton kernels, so the
graph replays far fewer launches.  Each shape compiles separately, so this suits a short ladder.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch

from specdec.engine.fixed_acceptance import FixedAcceptance
from specdec.engine.graph_warm_up import warm_up
from specdec.engine.kv_cache import KVCache
from specdec.engine.runner import fed_offsets, tree_mask_rows
from specdec.engine.scheduler import ScheduledSeq
from specdec.models.attention import AttentionBatch
from specdec.models.transformer import CausalLM


STAGING_RING = 8  # host staging buffers a runner's consecutive steps take in turn


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _input_size(batch: int, q: int, cols: int) -> int:
    return 3 * batch * q + batch + batch * cols


def _input_views(flat, batch: int, q: int, cols: int):
    """A (batch, q, cols) step's inputs as views of one flat buffer (torch tensor or numpy array):
    ids, positions, slots [batch * q], context lengths [batch], block tables [batch, cols].  Each shape's
    CUDA graph reads its own views, so the layout may differ from shape to shape."""
    rows = batch * q
    ids, positions, slots = flat[:rows], flat[rows:2 * rows], flat[2 * rows:3 * rows]
    ctx = flat[3 * rows:3 * rows + batch]
    tables = flat[3 * rows + batch:_input_size(batch, q, cols)].reshape(batch, cols)
    return ids, positions, slots, ctx, tables


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
        self.max_cols = -(-self.max_context // self.block_size)
        self.tree_masks = False  # enable_tree_masks()
        self._make_buffers(_input_size(self.max_batch, max_q, self.max_cols) + self.max_batch * max_q)  # + extra
        self.q_offsets = np.arange(max_q)
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # _graph_key -> graph, logits
        # Every captured graph writes its logits into this one buffer (rows of the largest shape): a graph
        # that kept its own output would hold [batch * q, V] per shape for good (GBs over a ladder).
        self.logits: torch.Tensor | None = None
        self.logits_rows_wanted = 0  # precapture's largest shape: the buffer is made this big at once
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.acceptance = FixedAcceptance(device, self.capture, self.pool)  # the sampler's, after a step here
        self.step: tuple[int, int, torch.Tensor] | None = None  # the last run's (batch, q, logits [batch q, V])
        self.replays = 0
        self.shapes: set[tuple[int, int, int]] = set()  # (batch, q, context) run by precapture()
        self.row_starts: list[int] = []  # the last step's first row of each sequence
        self.frozen = False  # after precapture(): other shapes run eagerly instead of capturing mid-serve
        self.q_ladder: list[int] = []  # the q values precapture() captured, ascending
        self.logits_like: torch.Tensor | None = None  # [0, V] as precapture()'s logits (precaptured_steps on a CPU)
        self._padded = self._padded_forward
        if compile_backend:
            self._padded = torch.compile(self._padded_forward, backend=compile_backend, dynamic=False)

    def _make_buffers(self, size: int) -> None:
        """A step's inputs live in one flat buffer (layout: _input_views) filled from a host staging buffer,
        pinned on a GPU, by a single asynchronous copy.  Consecutive steps stage in turn through a ring of
        buffers, so a step waits for the copy out of its buffer STAGING_RING steps ago, not the last one
        (which is queued behind the last forward): a drafter's chain queues its forwards without waiting."""
        self.inputs = torch.zeros(size, dtype=torch.long, device=self.device)
        ring = STAGING_RING if self.capture else 1
        self.staging = [torch.zeros(size, dtype=torch.long, pin_memory=self.capture) for _ in range(ring)]
        self.staged = [torch.cuda.Event() for _ in range(ring)] if self.capture else None  # copies done
        self.turn = 0  # the staging buffer of the next step

    def enable_tree_masks(self) -> None:
        """Stage a tree mask with every step of q > 1 (the module's note); call it before any graph is captured."""
        if self.graphs:
            raise RuntimeError("tree masks must be enabled before the runner captures its graphs")
        self.tree_masks = True
        rows = self.max_batch * self.max_q
        self._make_buffers(_input_size(self.max_batch, self.max_q, self.max_cols) + rows * self.max_q)

    def shape_of(self, seqs: list[ScheduledSeq]) -> tuple[int, int, int]:
        """The (batch, q, context) bucket a step of these sequences is padded to."""
        return self.bucket(len(seqs), max(s.num_new for s in seqs), max(s.request.num_computed for s in seqs))

    def bucket(self, num_seqs: int, most_fed: int, last_start: int) -> tuple[int, int, int]:
        """The (batch, q, context) bucket of num_seqs sequences feeding at most most_fed tokens each, the
        last of them starting at position last_start."""
        q = self._q_bucket(most_fed)
        return _next_power_of_two(num_seqs), q, _next_power_of_two(max(last_start + q, 256))

    def _q_bucket(self, q: int) -> int:
        """After precapture, the smallest captured q that holds q tokens per sequence (q itself if none does).

        Example: verify shapes captured for q in {1, 2, 3, 5, 9} (k in {0, 1, 2, 4, 8}); an n-gram step whose
        longest draft is 5 tokens feeds q = 6 and runs as the q = 9 graph, its rows 6..8 padding, instead
        of an eager forward (tens of ms at 8B).  The same happens when k is cut near a reply's max_tokens."""
        if not self.frozen:
            return q
        i = bisect.bisect_left(self.q_ladder, q)
        return self.q_ladder[i] if i < len(self.q_ladder) else q

    def can_run(self, seqs: list[ScheduledSeq]) -> bool:
        return self.shape_fits(self.shape_of(seqs)) and all(
            s.samples and s.request.num_tokens - s.request.num_computed == s.num_new - s.num_drafts for s in seqs)

    def shape_fits(self, shape: tuple[int, int, int]) -> bool:
        """Whether a (batch, q, context) bucket runs padded: within the buffers, and captured once frozen."""
        batch, q, context = shape  # max_batch and max_context are powers of two
        if self.frozen and shape not in self.shapes:
            return False  # e.g. a drafter catching up 7 tokens: one eager step beats a capture mid-serve
        return batch <= self.max_batch and q <= self.max_q and context <= self.max_context

    @torch.inference_mode()
    def run(self, seqs: list[ScheduledSeq], fed_ids: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Logits [q, V] per sequence (rows as in ModelRunner.forward); on a GPU they are views of the shared
        buffer, valid until this runner's next step.  fed_ids: see ModelRunner.forward (q is 1 then), copied
        over the staged ids on the device, after the upload."""
        batch, q, context = self.shape_of(seqs)
        self._fill(seqs, q, batch, context)
        ids = _input_views(self.inputs, batch, q, self._columns(context))[0]  # [batch * q]
        if fed_ids is not None:  # one token per sequence: row i is sequence i
            ids[:len(seqs)].copy_(fed_ids)
        logits = self._forward(batch, q, context)  # [batch * q, V]
        self.step = (batch, q, logits)
        self.row_starts = [i * q for i in range(len(seqs))]  # sequence i's rows: i * q ..
        # the rows the sampler reads: after the last fed token and after each draft (see ModelRunner.forward);
        # a short prefill feeds several prompt tokens but samples only after the last one
        return [logits[i * q + s.num_new - 1 - s.num_drafts:i * q + s.num_new] for i, s in enumerate(seqs)]

    def launch_accept(self, seqs: list[ScheduledSeq]):
        """Queue the acceptance of the last run's sequences on its fixed shape (engine/fixed_acceptance.py; the
        sampler checks they are eligible): a fixed_acceptance.Launched whose tokens stay on the device until
        `self.acceptance.read` brings them to the host (meanwhile the device runs what was queued behind it: a
        head's observe, engine/overlap.py's next step fed from them)."""
        return self.acceptance.launch(seqs, *self.step)

    def precapture(self, qs: list[int]) -> int:
        """Capture (on a CPU: run) every (batch, q, context) shape for the given q values up front, largest
        batch first, so that no served step pays for a capture; afterwards other shapes run eagerly
        (``frozen``).  Returns the number of shapes."""
        batches = [1 << i for i in range(self.max_batch.bit_length())]
        contexts = [c for c in (256 << i for i in range(20)) if c <= self.max_context]
        shapes = [(b, q, c) for q in sorted(set(qs)) if 1 <= q <= self.max_q
                  for b in reversed(batches) for c in contexts]
        self.logits_rows_wanted = max([b * q for b, q, _ in shapes] + [self.logits_rows_wanted])
        for batch, q, context in shapes:
            # padding rows only: scratch slots, no real sequence is touched
            self._stage([], q, batch, context, extra=self._extra([], batch))
            logits = self._forward(batch, q, context)
            self.logits_like = logits.new_empty((0, logits.shape[-1]))  # (not a view: it would keep the rows)
        self.shapes.update(shapes)
        self.q_ladder = sorted({q for _, q, _ in self.shapes})
        self.frozen = True
        return len(shapes)

    def precaptured_steps(self) -> list[tuple[int, int, torch.Tensor]]:
        """(batch, q, logits [batch q, V]) of each (batch, q) precapture() ran, for the acceptance's own precapture
        (FixedAcceptance.precapture): under graphs the logits rows its graphs write (one entry per buffer, should
        a capture have grown it since); on a CPU rows of one zero stand-in as wide (each eager step's logits are
        fresh tensors, so nothing there depends on the buffer)."""
        steps: dict[tuple, torch.Tensor | None] = {}
        for batch, q, context in sorted(self.shapes):
            logits = self.graphs[(batch, q, context)][1] if self.capture else None
            steps.setdefault((batch, q, None if logits is None else logits.data_ptr()), logits)
        rows = max([b * q for b, q, _ in steps] + [0])
        stand_in = self.logits_like.new_zeros(rows, self.logits_like.shape[-1]) if steps and not self.capture else None
        return [(b, q, logits if logits is not None else stand_in[:b * q]) for (b, q, _), logits in steps.items()]

    def _columns(self, context: int) -> int:
        """Block-table columns of a step whose context bucket is `context` tokens."""
        return -(-context // self.block_size)

    def _fill(self, seqs: list[ScheduledSeq], q: int, batch: int, context: int) -> None:
        """Stage the step's inputs for the (batch, q, context) bucket and copy them to the device at once."""
        rows, trees = [], []
        for seq in seqs:
            req = seq.request
            start, committed = req.num_computed, seq.num_new - seq.num_drafts
            ids = req.token_ids_between(start, start + committed) + req.draft_token_ids[:seq.num_drafts]
            rows.append((req.block_ids, start, ids))
            trees.append(seq if seq.tree_parents is not None else None)
        if any(trees) and not self.tree_masks:
            raise RuntimeError("a draft tree reached a runner without tree masks: enable_tree_masks() first")
        self._stage(rows, q, batch, context, extra=self._extra(seqs, batch), trees=trees)

    def _extra(self, seqs: list[ScheduledSeq], batch: int) -> list[int]:
        """Inputs a subclass stages after the step's own for these sequences (padded to batch; seqs may be
        empty: a step of padding only)."""
        return []

    def _stage(self, rows: list[tuple[list[int], int, list[int]]], q: int, batch: int, context: int,
               extra: list[int] = (), trees: list[ScheduledSeq | None] = ()) -> None:
        """Stage a padded step and copy it to the device: rows[i] = (blocks, first position, fed ids) of
        sequence i (at most q ids); `extra` follows the step's inputs in the same copy (a subclass's indices);
        trees[i], where given, is sequence i when its drafts are a tree (its positions and mask follow it)."""
        turn = self.turn
        self.turn = (turn + 1) % len(self.staging)
        if self.staged is not None:
            self.staged[turn].synchronize()  # the copy out of this buffer, STAGING_RING steps ago, is done
        staging = self.staging[turn]
        bs, cols, scratch = self.block_size, self._columns(context), self.kv_cache.scratch_block
        ids, positions, slots, ctx, tables = _input_views(staging.numpy(), batch, q, cols)
        ids, positions, slots = ids.reshape(batch, q), positions.reshape(batch, q), slots.reshape(batch, q)
        ids[:] = 0
        tables[:] = scratch  # padding sequences and unused columns point at the scratch block
        starts = np.zeros(batch, dtype=np.int64)
        fed = np.zeros(batch, dtype=np.int64)  # rows of each sequence that carry a real token
        for i, (blocks, start, fed_ids) in enumerate(rows):
            blocks = blocks[:cols]
            tables[i, :len(blocks)] = blocks
            starts[i] = start
            ids[i, :len(fed_ids)] = fed_ids
            fed[i] = len(fed_ids)
        # Row j of sequence i sits at position start_i + j; a real row writes its slot in the sequence's
        # blocks, a padding row (j >= fed_i, or a padding sequence) writes the scratch block.
        # Example (block size 16, q = 3): start 35, fed 2, blocks [7, 2, 9] -> positions 35, 36, 37,
        # slots 9*16+3, 9*16+4, then scratch*16+2 for the padding row.
        offsets = self.q_offsets[:q]
        in_order = starts[:, None] + offsets  # [batch, q] fed order: where each row's key is written
        block = np.take_along_axis(tables, np.minimum(in_order // bs, cols - 1), axis=1)
        slots[:] = np.where(offsets < fed[:, None], block * bs + in_order % bs, scratch * bs + offsets % bs)
        positions[:] = in_order
        ctx[:] = starts + q
        size = _input_size(batch, q, cols)
        if self.tree_masks and q > 1:
            mask = staging[size:size + batch * q * q].numpy().reshape(batch, q, q)
            mask[:] = np.tril(np.ones((q, q), dtype=np.int64))  # chains and padding: causal
            for i, seq in enumerate(trees):
                if seq is not None:
                    positions[i, :seq.num_new] = starts[i] + np.asarray(fed_offsets(seq))
                    mask[i, :seq.num_new] = np.asarray(tree_mask_rows([seq], q), dtype=np.int64)
            size += batch * q * q
        if extra:
            staging[size:size + len(extra)] = torch.as_tensor(extra, dtype=torch.long)
            size += len(extra)
        self.inputs[:size].copy_(staging[:size], non_blocking=True)
        if self.staged is not None:
            self.staged[turn].record()

    def _forward(self, batch: int, q: int, context: int) -> torch.Tensor:
        if not self.capture:
            return self._eager(batch, q, context)
        key = self._graph_key(batch, q, context)
        if key not in self.graphs:
            self.graphs[key] = self._capture(batch, q, context)
        graph, out = self.graphs[key]
        graph.replay()
        self.replays += 1
        return out

    def _graph_key(self, batch: int, q: int, context: int) -> tuple:
        """The key of the graph that runs this padded shape (a subclass adds what else its graphs differ by)."""
        return batch, q, context

    def _eager(self, batch: int, q: int, context: int) -> torch.Tensor:
        """The padded forward: logits [batch * q, V] for every row, padding included."""
        return self._padded(batch, q, context)

    def _padded_forward(self, batch: int, q: int, context: int) -> torch.Tensor:
        cols = self._columns(context)
        ids, positions, slots, ctx, tables = _input_views(self.inputs, batch, q, cols)
        tree = None
        if self.tree_masks and q > 1:
            size = _input_size(batch, q, cols)
            tree = self.inputs[size:size + batch * q * q].view(batch, q, q) != 0  # [batch, q, q]
        return self._call(ids, positions, self._uniform_attention(batch, q, ctx, tables, slots, context, tree),
                          batch * q)

    def _uniform_attention(self, batch: int, q: int, context_lens: torch.Tensor, tables: torch.Tensor,
                           slots: torch.Tensor, context: int, tree: torch.Tensor | None = None) -> AttentionBatch:
        """The AttentionBatch of a padded step: `batch` sequences of q query rows each, context_lens [batch],
        block tables [batch, columns], slots [batch * q], at most `context` keys a sequence."""
        return AttentionBatch(
            query_start=torch.arange(0, batch * q + 1, q, device=self.device),
            context_lens=context_lens,
            block_tables=tables,
            slot_mapping=slots,
            max_query_len=q,
            max_context_len=context,
            uniform=True,
            tree_mask=tree,
        ).prepare(self.block_size)

    def _call(self, ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBatch, rows: int) -> torch.Tensor:
        """The model on a padded step's rows (a subclass feeds other inputs beside them)."""
        return self.model(ids, positions, attn, self.kv_cache.layers)

    def _logits_buffer(self, rows: int, like: torch.Tensor) -> torch.Tensor:
        """rows rows of the shared logits buffer (columns and dtype as `like`), grown if too small; graphs
        captured before keep the old buffer."""
        if self.logits is None or self.logits.shape[0] < rows:
            rows_made = max(rows, self.logits_rows_wanted)
            self.logits = torch.empty(rows_made, *like.shape[1:], dtype=like.dtype, device=self.device)
        return self.logits[:rows]

    def _capture(self, batch: int, q: int, context: int):
        warm = warm_up(self.device, lambda: self._eager(batch, q, context))
        out = self._logits_buffer(batch * q, warm)
        del warm
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out.copy_(self._eager(batch, q, context))  # the forward's own output is freed: the pool reuses it
        return graph, out
