"""A fixed-shape step's acceptance (specdec/fixed_accept.py) on static buffers, as one CUDA graph per shape.

After a decode or verify step on the static runner, its logits buffer [B q, V] holds every sequence's rows at
fixed places.  FixedAcceptance stages the step's drafts and settings in one host -> device copy, draws the
sampled sequences' uniforms outside the graph (verify._draw_uniforms, into static buffers: seeded requests keep
their generators), replays the shape's graph (on a CPU, or a GPU without graphs, runs the same function
eagerly) and brings num_accepted and the tokens back in one copy.  `accept` waits for that copy; `launch` only
queues it (its tokens stay usable on the device: overlapped steps, engine/overlap.py, feed the next step from
them) and `read` waits for it later, on its own CUDA event, not for work queued after it.

Shape key: (B, q) and what the graph bakes in from the host: whether any sequence samples (else the softmax
is skipped: greedy only needs the argmax), whether any cuts top-k / top-p (else no sort), the width of the q
rows (0: no q this step) and whether they are in a reduced draft vocabulary, and under graphs the logits
buffer itself.

Memory: the graphs' temporaries live in the static runner's graph pool, held for good: processing every row of
the widest sampled shape, e.g. B q = 576 rows of V = 151,936 (350 MB a float32 copy), with the top-k / top-p sort
(an int64 order beside it) takes a few GB there at its peak; kv_cache.py's graph reserve (512 MB) does not count it.

Precapture (`precapture`, from Engine.precapture_graphs with fixed acceptance on): a graph captured at a step's
first use stalls that step (docs/BENCHMARKS.md; with the fused kernel, its Triton compiles too), so for every
(B, q) the static runner precaptured, these keys are captured before serving, from padding only (no request's
drafts, uniforms or generators), largest first: greedy only, sampled without cuts with the speculator's q rows
(Speculator.q_width: an EAGLE-3 head's draft vocabulary, mapped; the target's for a drafter or an MTP head
without a reduced vocabulary; none for n-gram or remote drafts, and none at q = 1), and where those rows exist,
sampled without them (a step of sequences with no drafts at q > 1: a catch-up, a head waking).  A drafter of
trees keeps its q > 1 steps off this path: only q = 1 there.  Cuts (top-k / top-p) and other widths still
capture at their first step.  E.g. max_num_seqs 64 with k up to 7 (k in {0, 1, 2, 4, 7}) and an EAGLE-3 head:
7 batches x 5 q = 35 (B, q), 7 x (2 + 3 x 4) = 98 graphs.  What they hold: each its own small buffers
(inputs, out, pinned host pairs: kB), the shared float32 scratch made at its largest at once, race [B_max, V]
(64 x 151,936: 39 MB) and, with q rows, q [B_max (q_max - 1), V_q] (64 x 7 x 151,936: 272 MB for a full-width
q; 256 sequences: 155 MB and 1.1 GB), which lazily a greedy-only serve never made; and in the pool, shared with
every other graph, the largest sampled shape's sort-free temporaries (a few [B q, V] float32 copies).  On a CPU
(or without graphs) nothing is captured: each key's body runs once eagerly, as the static runner's precapture
runs each forward, and its shape is made (the tests read `shapes`).

Fused kernel (`fused_kernel`: on a GPU whose Triton kernels work, models/fused.py Kernels.fused, unless
FUSED_KERNEL is off): a key without cuts runs specdec/kernels/accept.py's three launches in its graph instead of
accept_fixed's PyTorch operations (the same maths on the same uniforms, without materialising the processed
probabilities [B q, V]; on an H100 1.6-2.7x faster at B 1-64, docs/BENCHMARKS.md); keys with cuts keep
accept_fixed.

Which steps come here (sampler.sample_tokens decides, with `eligible`): the step ran on the static runner and
every sequence samples with a chain of drafts (or none), all q rows in one draft vocabulary.  Draft trees take
today's path (verify_tree.accept_tree).  Log-probs need nothing from here: they are read off the same rows.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from specdec import fixed_accept
from specdec.engine.graph_warm_up import warm_up
from specdec.engine.scheduler import ScheduledSeq
from specdec.models.fused import Kernels
from specdec.verify import _draw_uniforms

# Keys without top-k / top-p accepted by specdec/kernels/accept.py on a GPU (FixedAcceptance.fused_kernel)
FUSED_KERNEL = True


def eligible(seqs: list[ScheduledSeq]) -> bool:
    """Whether a static step's sequences can be accepted here: each samples with a chain of drafts or none, and
    the q rows there are share one draft vocabulary."""
    vocabs = {id(s.request.draft_vocab) for s in seqs if s.num_drafts and s.request.draft_probs is not None}
    return len(vocabs) <= 1 and all(s.samples and s.tree_parents is None for s in seqs)


class _Inputs(NamedTuple):
    """A (B, q) step's staged inputs, views of one flat long buffer (numpy on the host, torch on the device)."""

    drafts: object  # [B, q-1] each sequence's drafts, then 0
    test_index: object  # [B, q-1] each draft's uniform among the drawn tests (greedy and padding: 0, unread)
    q_rows: object  # [B, q-1] each draft's row of the stacked q (-1: one-hot)
    num_drafts: object  # [B]
    first: object  # [B] the row of the sequence's q rows that scores draft 0
    greedy: object  # [B] 0 / 1 (padding sequences: 1)
    top_k: object  # [B]
    race_index: object  # [B] the sequence's row of the drawn race uniforms (greedy and padding: 0, unread)
    temperature: object  # [B] float64 bits
    top_p: object  # [B] float64 bits

    @staticmethod
    def size(batch: int, q: int) -> int:
        return 3 * batch * (q - 1) + 7 * batch

    @staticmethod
    def of(flat, batch: int, q: int) -> _Inputs:
        """Three [B, q-1] grids, then seven [B] rows.  Example: B = 2, q = 3: drafts flat[0:4], test_index
        flat[4:8], q_rows flat[8:12], num_drafts flat[12:14], ..., top_p flat[24:26]."""
        k = q - 1
        grids = [flat[i * batch * k:(i + 1) * batch * k].reshape(batch, k) for i in range(3)]
        rows = [flat[3 * batch * k + i * batch:3 * batch * k + (i + 1) * batch] for i in range(7)]
        return _Inputs(*grids, *rows)


class _Shape:
    """One shape's static buffers (and its graph)."""

    def __init__(self, batch: int, q: int, logits: torch.Tensor, width: int, device: torch.device, scratch):
        self.batch, self.q = batch, q
        self.logits = logits.view(batch, q, -1)  # [B, q, V], the runner's buffer
        self.inputs = torch.zeros(_Inputs.size(batch, q), dtype=torch.long, device=device)
        pinned = device.type == "cuda"
        # Host buffers come in pairs taken in turn: with a step in flight (engine/overlap.py) the next step stages
        # and copies back while the host has yet to read this one, so it must not reuse this step's buffers.
        self.stagings = [torch.zeros(_Inputs.size(batch, q), dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        self.staged = [torch.cuda.Event() for _ in range(2)] if pinned else None  # the copies out of them done
        self.u_test = torch.zeros(max(1, batch * (q - 1)), device=device)  # [<= B (q-1)] drawn ragged
        self.u_race = scratch("race", batch, self.logits.shape[-1])  # [<= B, V] drawn rows
        self.q_probs = scratch(f"q{width}", batch * (q - 1), width) if width else None  # [<= B (q-1), V_q] stacked
        self.out = torch.zeros(batch, q + 1, dtype=torch.long, device=device)  # [B, 1 + q]: a_b, then tokens
        self.hosts = [torch.zeros_like(self.out, device="cpu", pin_memory=pinned) for _ in range(2)]
        self.done = [torch.cuda.Event() for _ in range(2)] if pinned else None  # the copies into them done
        self.turn = 0  # the pair's buffers the next step takes
        self.graph: torch.cuda.CUDAGraph | None = None


class Launched(NamedTuple):
    """An accepted step whose result may still be on its way to the host (`FixedAcceptance.read` waits for it)."""

    shape: _Shape
    turn: int  # its host buffers
    tokens: torch.Tensor  # [B, q] the step's emitted tokens on the device (shape.out's view, valid until the next
    # step of this shape is accepted: one queued behind it on the stream reads the values this step left)
    num_seqs: int

    @property
    def num_accepted(self) -> torch.Tensor:
        """[num_seqs] each sequence's accepted drafts on the device (out[:, 0]; valid as long as tokens is): what a
        head observing the step before the host reads it gathers its last rows by (speculate/head_ahead.py)."""
        return self.shape.out[:self.num_seqs, 0]


class FixedAcceptance:
    """Acceptance of a static runner's steps on their fixed shapes (the module's note): `launch` per step, then `read`
    (`accept` does both)."""

    def __init__(self, device: torch.device, capture: bool, pool=None):
        self.device = device
        self.capture = capture and device.type == "cuda"
        self.pool = pool  # the static runner's graph pool: the forward's and the acceptance's temporaries share it
        self.shapes: dict[tuple, _Shape] = {}
        self.vocab_ids: dict[int, torch.Tensor] = {}  # per q width: the staged draft vocabulary ([V_q] target ids)
        self.vocab_of: dict[int, torch.Tensor] = {}  # per q width: the drafter's tensor staged there
        self.steps = 0  # steps accepted here
        self.scratch: dict[str, torch.Tensor] = {}  # the large float32 inputs, shared by every shape
        # the module's note (tests set it on a CPU): Triton kernels that work here, as the engine found at start-up
        self.fused_kernel = FUSED_KERNEL and device.type == "cuda" and Kernels.fused

    def _scratch(self, name: str, rows: int, cols: int) -> torch.Tensor:
        """[rows, cols] float32 view of the shared buffer `name`, made larger when too small (shapes made before
        keep the old one, which their graphs read)."""
        flat = self.scratch.get(name)
        if flat is None or flat.numel() < rows * cols:
            flat = self.scratch[name] = torch.zeros(rows * cols, device=self.device)
        return flat[:rows * cols].view(rows, cols)

    def launch(self, seqs: list[ScheduledSeq], batch: int, q: int, logits: torch.Tensor) -> Launched:
        """Queue the acceptance of a (batch, q) step whose logits rows are logits [batch q, V] (every row, padding
        included) and the copy of its result to the host, without waiting for either (`read` does)."""
        sampled = [s for s in seqs if not s.request.params.greedy]
        # q rows matter only beside a sampled sequence (greedy ones take the argmax)
        with_q = [s for s in seqs if s.num_drafts and s.request.draft_probs is not None] if sampled else []
        width = with_q[0].request.draft_probs.shape[-1] if with_q else 0
        mapped = bool(with_q) and with_q[0].request.draft_vocab is not None
        cuts = any(s.request.params.cuts for s in sampled)
        key = self._key(batch, q, bool(sampled), cuts, width, mapped, logits)
        shape = self._shape(key, logits)
        turn, shape.turn = shape.turn, 1 - shape.turn
        self._stage(shape, turn, seqs, with_q, sampled)
        if mapped:
            self._stage_vocab(width, with_q[0].request.draft_vocab)
        self._run(shape, key)
        self.steps += 1
        return self._copy_back(shape, turn, len(seqs))

    def _key(self, batch: int, q: int, any_sampled: bool, cuts: bool, width: int, mapped: bool,
             logits: torch.Tensor) -> tuple:
        """A step's shape key (the module's note)."""
        # a graph reads the logits buffer it was captured on; eagerly each step's logits are fresh
        return batch, q, any_sampled, cuts, width, mapped, logits.data_ptr() if self.capture else None

    def _shape(self, key: tuple, logits: torch.Tensor) -> _Shape:
        """The key's shape, made at its first step, with the step's logits [B q, V] (under a graph, its buffer)."""
        batch, q, width = key[0], key[1], key[4]
        shape = self.shapes.get(key)
        if shape is None:
            shape = self.shapes[key] = _Shape(batch, q, logits, width, self.device, self._scratch)
        shape.logits = logits.view(batch, q, -1)  # [B, q, V] (the same buffer, under a graph)
        return shape

    @torch.no_grad()  # not inference_mode: its buffers stay normal tensors, which steps outside it may write too
    def precapture(self, steps: list[tuple[int, int, torch.Tensor]], width: int = 0, mapped: bool = False) -> int:
        """Capture (on a CPU: run once) before serving the graphs a served step of each (batch, q, logits
        [batch q, V]) in `steps` most likely needs: greedy only, and sampled without cuts with q rows `width` wide
        (`mapped`: in a reduced draft vocabulary) where q > 1, none where q = 1 (no drafts), and where width > 0
        sampled without q rows at q > 1 too.  Staged from padding
        only (no request is touched, no uniform drawn), largest shape first, through the served step's own
        _stage / _run.  Keys already made are left as they are; others (cuts, other widths) still capture at
        their first step.  Returns how many keys it made."""
        steps = sorted(steps, key=lambda step: (step[0] * step[1], step[0]), reverse=True)
        if steps:  # the shared buffers at their largest at once: a shape made before keeps the one it read
            self._scratch("race", max(b for b, _, _ in steps), steps[0][2].shape[-1])
            if width:
                self._scratch(f"q{width}", max(b * (q - 1) for b, q, _ in steps), width)
                if mapped:
                    self._vocab_buffer(width)  # zeros until a served step stages its draft vocabulary there
        made = 0
        for batch, q, logits in steps:
            w = width if q > 1 else 0
            keys = [self._key(batch, q, False, False, 0, False, logits),
                    self._key(batch, q, True, False, w, mapped and w > 0, logits)]
            if w:  # a step of sampled sequences without q rows (no drafts: a catch-up, a head waking)
                keys.append(self._key(batch, q, True, False, 0, False, logits))
            for key in keys:
                if key in self.shapes:
                    continue
                shape = self._shape(key, logits)
                turn, shape.turn = shape.turn, 1 - shape.turn
                self._stage(shape, turn, [], [], [])  # padding sequences only: greedy, nothing drawn
                self._run(shape, key)
                made += 1
        return made

    def accept(self, seqs: list[ScheduledSeq], batch: int, q: int, logits: torch.Tensor) -> list[list[int]]:
        """Each sequence's emitted tokens (accepted drafts + one) after a (batch, q) step whose logits rows are
        logits [batch q, V] (every row, padding included)."""
        return self.read(self.launch(seqs, batch, q, logits))

    def _stage(self, shape: _Shape, turn: int, seqs, with_q, sampled) -> None:
        """The drafts and settings in one copy; the sampled sequences' uniforms and the q rows into their
        buffers.  Draws and q rows are stacked in batch order over the sequences that have them.  Example:
        greedy, sampled (2 drafts), sampled (1 draft): the tests drawn are [u0, u1, u2] and the race rows
        [r0, r1], so test_index = ((0, 0), (0, 1), (2, 0)) and race_index = (0, 0, 1)."""
        if shape.staged is not None:
            shape.staged[turn].synchronize()  # the copy out of this buffer, two steps of this shape ago, is done
        staging = shape.stagings[turn]
        host = _Inputs.of(staging.numpy(), shape.batch, shape.q)
        temperature, top_p = host.temperature.view(np.float64), host.top_p.view(np.float64)
        staging.zero_()
        host.q_rows[:] = -1
        host.greedy[:] = 1  # padding sequences: greedy, nothing drawn for them
        top_p[:] = 1.0
        at_test, at_race, at_q, has_q = 0, 0, 0, {id(s) for s in with_q}
        for i, seq in enumerate(seqs):
            k, params = seq.num_drafts, seq.request.params
            host.drafts[i, :k] = seq.request.draft_token_ids[:k]
            host.num_drafts[i], host.first[i] = k, seq.num_new - 1 - k
            host.greedy[i], host.top_k[i], temperature[i], top_p[i] = \
                params.greedy, params.top_k, params.temperature, params.top_p
            if not params.greedy:  # its uniforms: drawn after the earlier sampled sequences' (_draw_uniforms)
                host.test_index[i, :k] = np.arange(at_test, at_test + k)
                host.race_index[i] = at_race
                at_test, at_race = at_test + k, at_race + 1
            if id(seq) in has_q:  # its q rows: stacked after the earlier sequences'
                host.q_rows[i, :k] = np.arange(at_q, at_q + k)
                at_q += k
        shape.inputs.copy_(staging, non_blocking=True)
        if shape.staged is not None:
            shape.staged[turn].record()
        if sampled:
            _draw_uniforms([s.request.generator for s in sampled], [s.num_drafts for s in sampled],
                           shape.u_race.shape[1], self.device, out=(shape.u_test, shape.u_race))
        if with_q:
            torch.cat([s.request.draft_probs[:s.num_drafts] for s in with_q], out=shape.q_probs[:at_q])

    def _stage_vocab(self, width: int, vocab_ids: torch.Tensor) -> None:
        """The draft vocabulary's target ids in a static buffer per q width (copied when it changes)."""
        if self.vocab_of.get(width) is vocab_ids:
            return
        self._vocab_buffer(width).copy_(vocab_ids)
        self.vocab_of[width] = vocab_ids

    def _vocab_buffer(self, width: int) -> torch.Tensor:
        """The static buffer [width] of the draft vocabulary's target ids (made at the first use: graphs read it)."""
        staged = self.vocab_ids.get(width)
        if staged is None:
            staged = self.vocab_ids[width] = torch.zeros(width, dtype=torch.long, device=self.device)
        return staged

    def _run(self, shape: _Shape, key: tuple) -> None:
        if not self.capture:
            self._body(shape, key)
            return
        if shape.graph is None:
            warm_up(self.device, lambda: self._body(shape, key))
            shape.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(shape.graph, pool=self.pool):
                self._body(shape, key)
        shape.graph.replay()

    def _body(self, shape: _Shape, key: tuple) -> None:
        """The graph's work: the shape's staged inputs -> out [B, 1 + q]."""
        _, _, any_sampled, cuts, width, mapped, _ = key
        x = _Inputs.of(shape.inputs, shape.batch, shape.q)
        draft_q = None
        if width:
            ids = self.vocab_ids[width] if mapped else None
            draft_q = fixed_accept.device_q(shape.q_probs, x.q_rows, ids, shape.logits.shape[-1])
        if self.fused_kernel and not cuts:
            self._fused_body(shape, x, draft_q, any_sampled)
            return
        a, tokens = fixed_accept.accept_fixed(
            shape.logits, x.first, x.drafts, x.num_drafts, x.greedy.bool(), x.temperature.view(torch.float64).float(),
            x.top_k, x.top_p.view(torch.float64).float(), shape.u_test[x.test_index],
            shape.u_race.index_select(0, x.race_index), draft_q, cuts=cuts, any_sampled=any_sampled)
        shape.out[:, 0] = a
        shape.out[:, 1:] = tokens

    @staticmethod
    def _fused_body(shape: _Shape, x: _Inputs, draft_q, any_sampled: bool) -> None:
        """The body of a key without cuts through specdec/kernels/accept.py: the race's exponentials E =
        -log1p(-u) made from the drawn uniforms (every row of the buffer: one pass), then the kernel's three
        launches, writing out."""
        from specdec.kernels.accept import accept_fused

        exponentials = torch.log1p(-shape.u_race).neg_() if any_sampled else shape.u_race  # [B, V] Exp(1)
        accept_fused(shape.logits, x.first, x.drafts, x.num_drafts, x.greedy, x.temperature.view(torch.float64).float(),
                     shape.u_test, x.test_index, exponentials, x.race_index, draft_q, any_sampled, out=shape.out)

    def _copy_back(self, shape: _Shape, turn: int, num_seqs: int) -> Launched:
        """Queue the one device -> host copy of the result (on a CPU, made at once)."""
        shape.hosts[turn].copy_(shape.out, non_blocking=shape.done is not None)
        if shape.done is not None:
            shape.done[turn].record()
        return Launched(shape, turn, shape.out[:, 1:], num_seqs)

    def read(self, launched: Launched) -> list[list[int]]:
        """The launched step's emitted tokens per sequence, once its copy to the host is done (a GPU waits for
        that copy's event only, not for work queued after it)."""
        shape, turn = launched.shape, launched.turn
        if shape.done is not None:
            shape.done[turn].synchronize()
        out = shape.hosts[turn][:launched.num_seqs].tolist()  # [n, 1 + q]: a_b, then tokens
        return [row[1:row[0] + 2] for row in out]
