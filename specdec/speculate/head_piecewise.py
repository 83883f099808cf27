"""A head's eager forwards with everything but attention replayed as CUDA graphs per token bucket, as
engine/piecewise.py does for the target's eager steps (opt-in, Eagle3Speculator.enable_piecewise: not yet
measured on a GPU; bench/spec_steps.py --head-piecewise).

The head's padded graphs (head_graphs.py) hold decode-like forwards of up to 33 positions a sequence; the rest
run eagerly: an observe of a prefill, a sleeping head's wake past the captured shapes, batches past the graphs'.
Eagerly, a one-layer head forward is ~400 PyTorch calls dispatched from Python, the same count at 16 positions
as at 2,048 (docs/BENCHMARKS.md has what one cost on a GPU).  Only attention
depends on the forward's layout, so the head runs as two pieces around it:

    stage ids, positions [T] and the projected features [T, H] (rows T..bucket zeroed)
    piece 0   embedding and its norm, the features' norm, their concatenation, q / k / v (normed, rotated)
    eager     write the keys/values, attend over the real T rows (attn.attend)
    piece 1   o_proj, the residual add and norm, the MLP                               -> the outputs [T, H]

Padding rows compute values nothing reads (every piece is row-wise; attention reads the first T rows and
writes no keys for the others).  On a CPU the pieces run eagerly on the same padded buffers, which is how the
tests check them.
"""

from __future__ import annotations

import torch

from specdec.engine.piecewise import BucketPieces
from specdec.models.attention import AttentionBatch
from specdec.models.eagle3 import Eagle3Head


class HeadPiecewise(BucketPieces):
    num_pieces = 2

    def __init__(self, head: Eagle3Head, device: torch.device, max_tokens: int, capture: bool):
        super().__init__(device, max_tokens, capture)
        self.head = head
        attn = head.midlayer.self_attn
        hidden, heads, kv_heads, dim = head.config.layer.hidden_size, attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.ids, self.positions = self._buffer(kind=torch.long), self._buffer(kind=torch.long)
        self.states, self.residual, self.out = self._buffer(hidden), self._buffer(hidden), self._buffer(hidden)
        self.q, self.k, self.v = self._buffer(heads, dim), self._buffer(kv_heads, dim), self._buffer(kv_heads, dim)
        self.attended = self._buffer(heads, dim)

    def _buffer(self, *shape: int, kind: torch.dtype | None = None) -> torch.Tensor:
        """A zeroed static buffer [widest bucket, *shape] (the head's dtype unless kind)."""
        kind = kind or self.head.lm_head.weight.dtype
        return torch.zeros(self.buckets[-1], *shape, dtype=kind, device=self.device)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, states: torch.Tensor, batch: AttentionBatch,
                kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """As Eagle3Head.forward: ids, positions [T], states [T, H] -> the head's outputs [T, H] (a fresh tensor)."""
        tokens, n = self._stage_rows((self.ids, ids), (self.positions, positions), (self.states, states))
        self._run(n, 0)
        attn = self.head.midlayer.self_attn
        self.attended[:tokens].copy_(attn.attend(self.q[:tokens], self.k[:tokens], self.v[:tokens], batch,
                                                 kv_cache))
        self._run(n, 1)
        self.forwards += 1
        return self.out[:tokens].clone()

    # ------------------------------------------------------------------ the pieces

    def _piece(self, n: int, piece: int) -> None:
        """Piece 0: the inputs to q / k / v; piece 1: after attention, to the outputs.  Reads and writes the static
        buffers' first n rows (Eagle3Head.forward's arithmetic, split at its attention)."""
        head = self.head
        layer = head.midlayer
        if piece == 0:
            embeds = layer.input_layernorm(head.embed_tokens(self.ids[:n]))  # [n, H]
            normed = layer.hidden_norm(self.states[:n])
            self.residual[:n].copy_(normed if head.config.norm_before_residual else self.states[:n])
            x = torch.cat([embeds, normed], dim=-1)  # [n, 2H]
            q, k, v = layer.self_attn.heads(x, head.rotary.lookup(self.positions[:n], x.dtype))
            self.q[:n].copy_(q)
            self.k[:n].copy_(k)
            self.v[:n].copy_(v)
            return
        attended = layer.self_attn.output(self.attended[:n])
        residual, h = layer.post_attention_layernorm.add_forward(self.residual[:n], attended)
        self.out[:n].copy_(residual + layer.mlp(h))
