"""Eager steps with everything but attention replayed as CUDA graphs ("piecewise" graphs; opt-in).

A step that prefills, or any step of a shape the captured decode/verify graphs do not cover, runs eagerly, and
an eager step of the 8-layer reference target costs 9-15 ms on an H200 whatever its size (bench/eager_steps.py):
about 2,000 PyTorch calls dispatched one by one from Python.  Only attention depends on the step's layout (its
query-length groups, contexts and block tables).  Everything between two attentions works row by row on
[T, hidden], so it can be captured once per token bucket (16, 32, ... up to the step budget) and replayed:

    copy ids and positions into static buffers (rows T..bucket padded with 0)
    piece 0       embedding, the first input norm, layer 0's q / k / v (normed, rotated)   -> static q, k, v
    per layer i   eager: write this step's keys/values, attend over the real T rows         -> static attended
                  piece i + 1: o_proj, residual adds and norms, MLP, then layer i + 1's q / k / v (or the
                  final norm after the last layer)
    lm_head on the rows to sample (eager: their number varies)

Padding rows compute values nothing reads: every piece is row-wise, attention reads only the first T rows, and
they write no keys.  Example: a 37-token step (a decode beside a 36-token prompt) runs in the 64-token bucket,
rows 37..63 padding.  On a CPU the pieces run eagerly on the same padded buffers, which is how the tests check
them.  Tensor parallelism is not supported here (its all-reduces would sit inside the pieces).
"""

from __future__ import annotations

import torch

from specdec.engine.graph_warm_up import warm_up
from specdec.models.attention import AttentionBatch
from specdec.models.transformer import CausalLM, KVCaches

SMALLEST_BUCKET = 16


class BucketPieces:
    """Pieces of a forward captured as CUDA graphs once per token bucket (16, 32, ... up to max_tokens) and
    replayed, or run eagerly on a CPU: what PiecewiseRunner and the head's (speculate/head_piecewise.py) share.
    A subclass sets num_pieces and implements _piece(n, piece) on its static buffers' first n rows."""

    num_pieces: int

    def __init__(self, device: torch.device, max_tokens: int, capture: bool):
        self.device = device
        self.capture = capture and device.type == "cuda"
        self.buckets = [SMALLEST_BUCKET]
        while self.buckets[-1] < max_tokens:
            self.buckets.append(2 * self.buckets[-1])
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}  # bucket -> one graph per piece
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.forwards = 0

    def fits(self, tokens: int) -> bool:
        return tokens <= self.buckets[-1]

    def bucket(self, tokens: int) -> int:
        return next(b for b in self.buckets if b >= tokens)

    def _stage_rows(self, *inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[int, int]:
        """Copy each (static buffer, values [T, ...]) into the buffer's first T rows, rows T..bucket zeroed:
        -> (T, the bucket)."""
        tokens = inputs[0][1].shape[0]
        n = self.bucket(tokens)
        for buffer, values in inputs:
            buffer[:tokens].copy_(values)
            buffer[tokens:n].zero_()
        return tokens, n

    def capture_all(self) -> int:
        """Capture every bucket's pieces (on a GPU; nothing to do on a CPU); returns the graphs captured."""
        if not self.capture:
            return 0
        for n in self.buckets:
            if n not in self.graphs:
                self.graphs[n] = self._capture(n)
        return sum(len(g) for g in self.graphs.values())

    def _run(self, n: int, piece: int) -> None:
        if not self.capture:
            self._piece(n, piece)
            return
        if n not in self.graphs:
            self.graphs[n] = self._capture(n)
        self.graphs[n][piece].replay()

    def _piece(self, n: int, piece: int) -> None:
        raise NotImplementedError

    def _capture(self, n: int) -> list[torch.cuda.CUDAGraph]:
        pieces = range(self.num_pieces)
        warm_up(self.device, lambda: [self._piece(n, piece) for piece in pieces])  # (compiled kernels' first calls)
        graphs = []
        for piece in pieces:  # temporaries live in the shared pool; outputs go to the static buffers
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self._piece(n, piece)
            graphs.append(graph)
        return graphs


class PiecewiseRunner(BucketPieces):
    def __init__(self, model: CausalLM, device: torch.device, max_tokens: int, capture: bool):
        super().__init__(device, max_tokens, capture)
        self.model = model
        self.num_layers = len(model.model.layers)
        self.num_pieces = self.num_layers + 1
        self.ids, self.positions = self.buffer(kind=torch.long), self.buffer(kind=torch.long)
        hidden = model.config.hidden_size
        self.x, self.h = self.buffer(hidden), self.buffer(hidden)  # residual stream; normed
        self._layer_buffers()

    def buffer(self, *shape: int, kind: torch.dtype | None = None) -> torch.Tensor:
        """A zeroed static buffer [widest bucket, *shape] (the model's dtype unless kind)."""
        kind = kind or self.model.model.embed_tokens.weight.dtype
        return torch.zeros(self.buckets[-1], *shape, dtype=kind, device=self.device)

    def _layer_buffers(self) -> None:
        """The static buffers between the pieces and attention (engine/piecewise_hybrid.py has its own)."""
        attn = self.model.model.layers[0].self_attn
        heads, kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.cos, self.sin = self.buffer(1, head_dim), self.buffer(1, head_dim)
        self.q, self.k, self.v = (self.buffer(heads, head_dim), self.buffer(kv_heads, head_dim),
                                  self.buffer(kv_heads, head_dim))
        self.attended = self.buffer(heads, head_dim)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch, kv_caches: KVCaches,
                logits_index: torch.Tensor | None = None) -> torch.Tensor:
        """As CausalLM.forward: ids, positions [T] -> logits [N, V] at logits_index (all T rows if None)."""
        tokens, n = self._stage(ids, positions)
        self._run(n, 0)
        for i, kv_cache in enumerate(kv_caches):
            self.model.keep_feature(i, self.x[:tokens])  # the residual stream entering layer i
            attn = self.model.model.layers[i].self_attn
            self.attended[:tokens].copy_(attn.attend(self.q[:tokens], self.k[:tokens], self.v[:tokens], batch,
                                                     kv_cache))
            self._run(n, i + 1)
        return self._logits(tokens, logits_index)

    def _stage(self, ids: torch.Tensor, positions: torch.Tensor) -> tuple[int, int]:
        """Copy ids, positions [T] into the static buffers, rows T..bucket zeroed: -> (T, the bucket)."""
        return self._stage_rows((self.ids, ids), (self.positions, positions))

    def _logits(self, tokens: int, logits_index: torch.Tensor | None) -> torch.Tensor:
        """After the last piece: keep the final feature, count the forward, -> logits [N, V]."""
        hidden = self.h[:tokens]
        self.model.keep_feature(self.num_layers, hidden)  # the final feature
        self.forwards += 1
        return self.model.lm_head(hidden if logits_index is None else hidden[logits_index])

    # ------------------------------------------------------------------ the pieces

    def _piece(self, n: int, piece: int) -> None:
        """Piece 0: embedding to layer 0's q / k / v; piece i + 1: layer i after its attention, to layer i + 1's
        q / k / v (or the final norm).  Reads and writes the static buffers' first n rows."""
        if piece == 0:
            x, h, (cos, sin) = self.model.embed_piece(self.ids[:n], self.positions[:n])
            self.cos[:n].copy_(cos)
            self.sin[:n].copy_(sin)
        else:
            x, h = self.model.post_attention_piece(piece - 1, self.x[:n], self.attended[:n])
        self.x[:n].copy_(x)
        if piece == self.num_layers:
            self.h[:n].copy_(h)
            return
        q, k, v = self.model.model.layers[piece].self_attn.heads(h, (self.cos[:n], self.sin[:n]))
        self.q[:n].copy_(q)
        self.k[:n].copy_(k)
        self.v[:n].copy_(v)

