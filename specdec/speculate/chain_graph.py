"""An EAGLE-3 head's whole draft chain as one padded step, replayed as one CUDA graph on a GPU.

Step by step, a chain of depth D costs the host D - 1 stagings and forward replays and D draws of a few
kernels each, launched one after another.  Here everything is staged at once and one graph per (batch,
depth, context) bucket runs, on the device:

    draw 0 from the given first logits
    for i in 1 .. D - 1: head forward feeding draft i - 1 at position start + i - 1 beside the previous
                         output state -> logits -> draw i

Draws read each row's settings as tensors (temperature, 0 = greedy; top_k, 0 = off; top_p) and one uniform
a draw (processed_probs_tensors, then inverse_cdf: a greedy row's one-hot q gives its argmax whatever the
uniform).  A chain in which no row cuts its distribution by top-k or top-p (the host knows) runs graphs that
skip the sort those cuts need: graphs are keyed by (batch, depth, context, cuts).  Outputs: the drafts [B, D]
as target ids and each draw's q [B, D, V_draft].

The chain's forwards are staged as one StaticRunner step of q = D tokens a sequence (`_stage`): sequence i's
row j is forward j + 1's, at position start_i + j, and carries a real token for j < k_i - 1 only; its other
rows (a shorter chain's extra forwards, and the unused last row) get the scratch slot, so a request never
writes past its chain.  Forward j reads row j of every sequence: its position and slot, and context length
position + 1.  Example (block size 4): requests with k 3 and 1 at start 9 and 5, depth 3: positions
[[9, 10, 11], [5, 6, 7]]; slots [[b(9), b(10), scratch], [scratch, scratch, scratch]], b(p) the slot of p in
the request's own blocks.  Its rows past its chain compute garbage that nobody reads.
"""

from __future__ import annotations

import torch

from specdec.engine.kv_cache import KVCache
from specdec.engine.request import Request
from specdec.engine.static_runner import StaticRunner, _input_views
from specdec.models.eagle3 import Eagle3Head
from specdec.sampling import processed_probs_tensors
from specdec.speculate.draw import inverse_cdf
from specdec.transfer import upload


class ChainGraphs(StaticRunner):
    """Shapes are (batch, depth, context): StaticRunner's buckets with q = the chain's depth."""

    def __init__(self, head: Eagle3Head, kv_cache: KVCache, device: torch.device, max_batch: int, max_depth: int,
                 max_context: int, capture: bool, target_ids: torch.Tensor | None, pool=None):
        super().__init__(head, kv_cache, device, max_batch, max_depth, max_context, capture)
        if pool is not None:  # the head's other graphs' pool: replayed one after another, they share its memory
            self.pool = pool
        rows, dtype = self.max_batch, head.lm_head.weight.dtype
        self.target_ids = target_ids  # [V_draft] or None: draft id i is target id i
        self.max_position = head.config.layer.max_position_embeddings - 1
        # the graph's other inputs, copied in before each replay (padding rows keep stale values: unread)
        self.states = torch.zeros(rows, head.config.layer.hidden_size, dtype=dtype, device=device)  # [rows, H]
        self.first_logits = torch.zeros(rows, head.config.draft_vocab_size, dtype=dtype, device=device)
        self.settings = torch.zeros(3, rows, device=device)  # temperature, top_k, top_p per row (float32)
        self.uniforms = torch.zeros(rows, max_depth, device=device)  # [rows, depth] one per draw
        self.tokens = torch.zeros(rows, max_depth, dtype=torch.long, device=device)  # the graph's drafts
        self.cuts = False  # whether the chain being run has a row with top-k or top-p (its draws sort)

    def chain_shape(self, active: list[tuple[Request, int]], firsts: list[int] | None = None) -> tuple[int, int, int]:
        """The (batch, depth, context) bucket of a chain of these (request, k), longest k first; firsts: each
        chain's first position, where it is not num_tokens - 1 (a chain launched ahead: its latest possible)."""
        last_start = max(firsts) if firsts is not None else max(req.num_tokens - 1 for req, _ in active)
        return self.bucket(len(active), active[0][1], last_start)

    @torch.inference_mode()
    def run_chain(self, active: list[tuple[Request, int]], shape: tuple[int, int, int], states: torch.Tensor,
                  logits: torch.Tensor, uniforms: torch.Tensor | None, firsts: list[int] | None = None,
                  shift: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """active: (request, k), longest first; states [B, H] and logits [B, V_draft]: the head's last outputs;
        uniforms [B, k_max] or None (every row greedy) -> (drafts [batch, depth] target ids, q [batch, depth,
        V_draft]); row i's first k_i are its chain.  The drafts are a view valid until the next run.

        firsts: each chain's first position as staged (default num_tokens - 1); shift [B] on the device: added
        to it there after staging (`shift_staged`), for a chain launched before the host knows how far each
        request got (Eagle3Speculator.propose_ahead)."""
        batch, depth, context = shape
        count = len(active)
        if firsts is None:
            firsts = [req.num_tokens - 1 for req, _ in active]
        # forward j + 1 of request i feeds position firsts_i + j; it has k_i - 1 forwards
        self._stage([(req.block_ids, first, [0] * (k - 1)) for (req, k), first in zip(active, firsts)],
                    depth, batch, context)
        if shift is not None:
            self.shift_staged(shape, shift, [k - 1 for _, k in active])
        self.states[:count].copy_(states)
        self.first_logits[:count].copy_(logits)
        self.settings[:, :batch].copy_(upload(self._settings(active, batch), self.device, torch.float32))
        self.cuts = any(req.params.cuts for req, _ in active)
        if uniforms is None:
            self.uniforms[:count].zero_()
        else:
            self.uniforms[:count, :uniforms.shape[1]].copy_(uniforms)
        q = self._forward(batch, depth, context)  # [batch * depth, V_draft]
        return self.tokens[:batch, :depth], q.view(batch, depth, -1)

    def shift_staged(self, shape: tuple[int, int, int], shift: torch.Tensor, fed: list[int]) -> None:
        """Move the staged chains of the first len(fed) sequences shift [len(fed)] positions on, on the device:
        their positions and context lengths, and the slots of their real rows (j < fed_i), recomputed from
        their block tables; padding rows keep their scratch slots.  What `_stage` would have staged had it
        been given first position + shift, with no host sync.

        Example (block size 4, depth 3): a chain of k = 3 (fed 2) staged at position 10 with blocks [7, 2, 9,
        5] has positions 10, 11, 12 and slots 9*4+2, 9*4+3, scratch; shifted by 2: positions 12, 13, 14,
        context length + 2, slots 5*4+0, 5*4+1 (block 12 // 4 = 3 of the table), scratch as staged."""
        batch, depth, context = shape
        count, cols, bs = len(fed), self._columns(context), self.block_size
        _, positions, slots, ctx, tables = _input_views(self.inputs, batch, depth, cols)
        positions = positions.view(batch, depth)[:count]  # [count, depth] views of the staged inputs
        slots = slots.view(batch, depth)[:count]
        positions += shift[:, None]
        ctx[:count] += shift
        block = tables[:count].gather(1, (positions // bs).clamp(max=cols - 1))  # [count, depth]
        real = torch.arange(depth, device=self.device) < upload(fed, self.device)[:, None]
        slots.copy_(torch.where(real, block * bs + positions % bs, slots))

    def _graph_key(self, batch: int, depth: int, context: int) -> tuple:
        """A chain's graphs differ by its cuts as well (the draws sort or not)."""
        return batch, depth, context, self.cuts

    @staticmethod
    def _settings(active: list[tuple[Request, int]], batch: int) -> list[list[float]]:
        """[3, batch]: temperature, top_k, top_p of each row; padding rows greedy."""
        params = [req.params for req, _ in active]
        pad = [0.0] * (batch - len(params))
        return [[p.temperature for p in params] + pad, [float(p.top_k) for p in params] + pad,
                [float(p.top_p) for p in params] + pad]

    def _padded_forward(self, batch: int, depth: int, context: int) -> torch.Tensor:
        """The chain: depth draws and the depth - 1 forwards between them -> q [batch * depth, V_draft] (the
        drafts go to self.tokens)."""
        _, positions, slots, _, tables = _input_views(self.inputs, batch, depth, self._columns(context))
        positions = positions.view(batch, depth).clamp(max=self.max_position)  # past a chain's end: unread
        slots = slots.view(batch, depth)
        states, logits, qs = self.states[:batch], self.first_logits[:batch], []
        for i in range(depth):
            if i:
                states = self._step(self.tokens[:batch, i - 1], states, positions[:, i - 1].contiguous(),
                                    slots[:, i - 1].contiguous(), tables, context)
                logits = self.model.logits(states)  # [batch, V_draft]
            qs.append(self._draw(logits, i, batch))
        return torch.stack(qs, 1).view(batch * depth, -1)

    def _draw(self, logits: torch.Tensor, i: int, batch: int) -> torch.Tensor:
        """Draw i of every row from logits [batch, V_draft] into self.tokens[:, i] -> its q [batch, V_draft]."""
        temperature, top_k, top_p = self.settings[:, :batch]
        q = processed_probs_tensors(logits, temperature, top_k.long(), top_p, cuts=self.cuts)
        drafts = inverse_cdf(q, self.uniforms[:batch, i:i + 1])[:, 0]  # [batch] draft ids
        self.tokens[:batch, i].copy_(drafts if self.target_ids is None else self.target_ids[drafts])
        return q

    def _step(self, ids: torch.Tensor, states: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
              tables: torch.Tensor, context: int) -> torch.Tensor:
        """One head forward of one token a sequence: ids, positions, slots [batch], states [batch, H] ->
        [batch, H]; each sequence sees its keys up to its position."""
        attn = self._uniform_attention(len(ids), 1, positions + 1, tables, slots, context)
        return self.model(ids, positions, states, attn, self.kv_cache.layers[0])
