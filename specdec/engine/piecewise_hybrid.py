"""Piecewise graphs for Qwen3.5 hybrid models: eager steps with everything but each token mixer's core replayed
as CUDA graphs (opt-in: EngineConfig.piecewise_graphs=True; off by default until measured on a GPU).

As engine/piecewise.py does for Qwen3, but a hybrid layer's token mixer is a Gated DeltaNet or a gated full
attention, each split in three (models/qwen3_5.py HybridDecoderLayer): a row-wise pre_mixer, a shape-dependent
core and a row-wise post_mixer.  Only the cores run eagerly: full attention's key/value write and paged attention,
and the DeltaNet's causal conv, delta rule and state store, which follow the step's sequence groups
(plan_groups, once per step) and state slots.  Per step:

    copy ids and positions into static buffers (rows T..bucket padded with 0)
    piece 0       embedding, layer 0's input norm and pre_mixer        -> static mixed, z, b, a  (DeltaNet)
                                                                          or q, k, v, gate      (attention)
    per layer i   eager: its core over the real T rows                  -> static delta (DeltaNet) or attended
                  piece i + 1: layer i's post_mixer (gated norm with z and out_proj, or gate and o_proj),
                  residual adds and norms, MLP, then layer i + 1's input norm and pre_mixer (or the final norm)
    lm_head on the rows to sample (eager: their number varies)

Example: the 4-layer tiny twin [attention, DeltaNet, DeltaNet, attention] on a 37-token step (two decodes beside
a 35-token prefill chunk) runs in the 64-token bucket: 5 pieces replayed, 4 cores eager (the DeltaNet cores as
two groups: n = 1 for the decodes, n = 35 for the chunk), rows 37..63 padding.  Padding rows compute values
nothing reads: the pieces are row-wise and the cores read only the first T rows.  The buffers of one mixer kind
are shared by all its layers (the pieces run in order).  Features (model.capture_features) are kept as the plain
forward keeps them.  On a CPU the pieces run eagerly on the same padded buffers, which is how the tests check them.
"""

from __future__ import annotations

import torch

from specdec.engine.piecewise import PiecewiseRunner
from specdec.models.attention import AttentionBatch
from specdec.models.gated_deltanet import plan_groups
from specdec.models.transformer import KVCaches


class HybridPiecewiseRunner(PiecewiseRunner):
    """PiecewiseRunner for a HybridCausalLM: same buckets, staging and capture; its own buffers and pieces."""

    def _layer_buffers(self) -> None:
        """self.pre[is_linear]: the pre_mixer outputs of that mixer kind; self.cores[is_linear]: its core's."""
        c, buffer = self.model.config, self.buffer
        self.pre: dict[bool, tuple] = {}
        self.cores: dict[bool, torch.Tensor] = {}
        self.cos = self.sin = None
        if c.is_hybrid:  # mixed [R, conv_dim], z [R, Hv*Dv], b, a [R, Hv]; core [R, Hv, Dv]
            heads = c.linear_num_value_heads
            self.pre[True] = (buffer(c.linear_conv_dim), buffer(c.linear_value_dim), buffer(heads), buffer(heads))
            self.cores[True] = buffer(heads, c.linear_value_head_dim)
        if c.num_attention_layers:  # q, gate [R, H, D], k, v [R, Hkv, D]; attended [R, H, D]; cos, sin [R, 1, rot]
            heads, kv_heads, dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
            gate = buffer(heads, dim) if c.attn_output_gate else None
            self.pre[False] = (buffer(heads, dim), buffer(kv_heads, dim), buffer(kv_heads, dim), gate)
            self.cores[False] = buffer(heads, dim)
            self.cos, self.sin = buffer(1, c.rotary_dim), buffer(1, c.rotary_dim)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch, kv_caches: KVCaches,
                logits_index: torch.Tensor | None = None) -> torch.Tensor:
        """As HybridCausalLM.forward: ids, positions [T] -> logits [N, V] at logits_index (all T rows if None)."""
        self.model._check_inputs(batch, kv_caches)
        tokens, n = self._stage(ids, positions)
        groups = plan_groups(batch) if self.model.config.is_hybrid else []
        caches = iter(kv_caches)
        self._run(n, 0)
        for i, layer in enumerate(self.model.model.layers):
            self.model.keep_feature(i, self.x[:tokens])  # the residual stream entering layer i
            kv_cache = None if layer.is_linear else next(caches)
            core = layer.core(_rows(self.pre[layer.is_linear], tokens), batch, kv_cache, groups)
            self.cores[layer.is_linear][:tokens].copy_(core)
            self._run(n, i + 1)
        return self._logits(tokens, logits_index)

    def _piece(self, n: int, piece: int) -> None:
        """Piece 0: embedding to layer 0's pre_mixer; piece i + 1: layer i after its core, to layer i + 1's
        pre_mixer (or the final norm).  Reads and writes the static buffers' first n rows."""
        model, layers = self.model, self.model.model.layers
        if piece == 0:
            x, h, cos_sin = model.embed_piece(self.ids[:n], self.positions[:n])
            if cos_sin is not None:
                self.cos[:n].copy_(cos_sin[0])
                self.sin[:n].copy_(cos_sin[1])
        else:
            linear = layers[piece - 1].is_linear
            x, h = model.post_mixer_piece(piece - 1, self.x[:n], self.cores[linear][:n], _rows(self.pre[linear], n))
        self.x[:n].copy_(x)
        if piece == self.num_layers:
            self.h[:n].copy_(h)
            return
        layer = layers[piece]
        cos_sin = None if self.cos is None else (self.cos[:n], self.sin[:n])
        for buffer, value in zip(self.pre[layer.is_linear], layer.pre_mixer(h, model.rotary, cos_sin)):
            if buffer is not None:  # (no gate buffer when attention is not gated)
                buffer[:n].copy_(value)


def _rows(buffers: tuple, n: int) -> tuple:
    """The first n rows of each buffer (None stays None)."""
    return tuple(None if b is None else b[:n] for b in buffers)
