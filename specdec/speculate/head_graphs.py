"""An EAGLE-3 head's forwards on fixed-shape buffers, replayed as CUDA graphs on a GPU.

A head forward is one decoder layer: a fraction of a millisecond of GPU work at 8B shapes, but tens of kernel
launches and, built eagerly from host lists, several uploads that each wait for the device to drain.  Here a
forward is padded to a (batch, q, context) bucket exactly as StaticRunner pads the target's steps (rows,
scratch block, staging ring, capture), so the k - 1 chain forwards are queued without waiting for one
another and each bucket is captured once and replayed.

Two kinds of forwards take this path: a chain step feeds one token per sequence (q = 1); an observe step
after a verify feeds each sequence's committed positions, 1 .. k + 1 of them (q = the most, rounded up to a
captured q).  The head's input states are a second input beside the token ids: a forward's T real rows
(sequence i's tokens at padded rows i*q ..) are scattered into the states buffer and its outputs gathered back
through one row index, staged with the step's other inputs.

Example: two sequences feeding 3 and 1 positions (q = 3, batch 2): real rows 0, 1, 2 and 3; the row index is
[0, 1, 2, 3]; states [4, H] land at padded rows 0..3, rows 4 and 5 pad the second sequence (scratch slots),
and outputs [4, H] are padded rows 0..3 read back.  With counts 1 and 3: row index [0, 3, 4, 5].

Ids come from the host, or from the device without a host sync: a chain step's drawn drafts (one per
sequence), or an observe launched ahead of the host's read of acceptance (speculate/head_ahead.py observe_ahead),
fed the acceptance's emitted tokens [B, q] as they lie there, row i sequence i's.

Logits or not: a forward's graph computes the outputs' logits over the draft vocabulary beside them (the next
chain's first draw reads them), a GEMV over the whole LM head on every row.  An observe of a step that drafted
nothing (k = 0, often under load) is rarely followed by a chain, so it runs a second HeadGraphs built
`with_logits=False`, which returns the outputs alone (logits None; a chain after it computes them from the
head's last output).  A second instance rather than a flag in the graph key: StaticRunner keys its graphs, its
precaptured `shapes` and its q ladder by (batch, q, context), and an instance of its own keeps that key and
captures only q = 1 (max_q 1: the one position a sequence that a k = 0 decode step commits), sharing the head's
KV cache and graph pool as ChainGraphs does.  Observes of other shapes keep the graphs with logits.
"""

from __future__ import annotations

import torch

from specdec.engine.kv_cache import KVCache
from specdec.engine.static_runner import StaticRunner, _input_size, _input_views
from specdec.models.attention import AttentionBatch
from specdec.models.eagle3 import Eagle3Head

Layout = list[tuple[list[int], int, int]]  # per sequence: (block ids, first position, tokens fed)


class HeadGraphs(StaticRunner):
    def __init__(self, head: Eagle3Head, kv_cache: KVCache, device: torch.device, max_batch: int, max_q: int,
                 max_context: int, capture: bool, with_logits: bool = True, pool=None):
        """with_logits: whether a forward computes its outputs' logits too (the module's note); pool: another
        HeadGraphs' graph pool to share (they replay one after another)."""
        super().__init__(head, kv_cache, device, max_batch, max_q, max_context, capture)
        self.with_logits = with_logits
        if pool is not None:
            self.pool = pool
        rows = self.max_batch * max_q
        self.states = torch.zeros(rows, head.config.layer.hidden_size, dtype=head.lm_head.weight.dtype,
                                  device=device)  # [rows, H] the padded forward's input states

    def layout_shape(self, layout: Layout) -> tuple[int, int, int]:
        """The (batch, q, context) bucket of a forward of this layout (shape_fits says whether it runs padded)."""
        return self.bucket(len(layout), max(n for _, _, n in layout), max(start for _, start, _ in layout))

    @torch.inference_mode()
    def run_layout(self, layout: Layout, shape: tuple[int, int, int], ids: list[int] | torch.Tensor,
                   states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The head's outputs [T, H] and their logits [T, V_draft] (views of a fresh tensor; None without
        with_logits) for T = sum of the layout's token counts, padded to shape (layout_shape), fed ids beside
        states [T, H].  ids: a host list [T]; or a device tensor (no host sync): [T] when every sequence feeds
        one token, or a grid [B_ids, q_ids] whose row i holds sequence i's ids first (count_i <= q_ids; what
        follows in the row is never read)."""
        batch, q, context = shape
        host_ids = isinstance(ids, list)
        rows, taken, index = [], 0, []
        for blocks, start, count in layout:
            rows.append((blocks, start, ids[taken:taken + count] if host_ids else [0] * count))
            index.extend(range(len(rows) * q - q, len(rows) * q - q + count))
            taken += count
        self._stage(rows, q, batch, context, extra=index)
        cols = self._columns(context)
        index_view = self.inputs[_input_size(batch, q, cols):][:taken]
        if not host_ids:
            grid = ids.view(-1, 1) if ids.dim() == 1 else ids  # [B_ids, q_ids]
            self._fill_ids(_input_views(self.inputs, batch, q, cols)[0].view(batch, q), grid, len(layout))
        self.states.index_copy_(0, index_view, states)
        out = self._forward(batch, q, context).index_select(0, index_view)  # [T, H + V_draft], or [T, H]
        if not self.with_logits:
            return out, None
        hidden = self.states.shape[1]
        return out[:, :hidden], out[:, hidden:]

    @staticmethod
    def _fill_ids(padded: torch.Tensor, grid: torch.Tensor, num_seqs: int) -> None:
        """Copy device ids grid [B_ids, q_ids] over the staged ids padded [batch, q] of num_seqs sequences, one
        rectangle on the device.  Sequence i's real rows are i q .. i q + count_i - 1, so row i's first count_i
        ids land there; the rest of the rectangle lands on padding rows (scratch slots, outputs dropped), clamped
        to a valid id (an acceptance's tokens end in -1).  Example: q = 4, grid [[7, 8, -1], [9, -1, -1]] with
        counts 2 and 1: padded rows 0, 1 <- 7, 8 and row 4 <- 9 (real); rows 2 and 5, 6 <- 0 (padding)."""
        width = min(padded.shape[1], grid.shape[1])
        padded[:num_seqs, :width].copy_(grid[:num_seqs, :width].clamp(min=0))

    def _call(self, ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBatch, rows: int) -> torch.Tensor:
        """[rows, H + V_draft]: the head's outputs beside their logits (the next draw's, inside the graph); without
        with_logits the outputs alone [rows, H]."""
        hidden = self.model(ids, positions, self.states[:rows], attn, self.kv_cache.layers[0])
        if not self.with_logits:
            return hidden
        return torch.cat([hidden, self.model.logits(hidden).to(hidden.dtype)], dim=-1)
