"""One teacher-forced step of each draft head on [B, T] batches: what train/head_loss.py's unrolling calls
(its UnrolledHead).  The steps compute what the heads' own forwards (models/eagle3.py, models/mtp.py) compute
while drafting; only the attention differs, the unrolling's chain attention in place of the paged cache."""

from __future__ import annotations

import torch
from torch import nn

from specdec.models.eagle3 import Eagle3Head
from specdec.models.mtp import MTPHead
from specdec.models.qwen3_5 import PartialRotary


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, D] by cos/sin [T, 1, D] (rotate-half, as models/fused.rotate)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class Eagle3Unroll:
    """EAGLE-3: state 0 = fc(the three feature layers); a step's output is the residual stream before the head's
    final norm; logits over the draft vocabulary."""

    def __init__(self, head: Eagle3Head):
        self.head = head
        self.scale = head.midlayer.self_attn.scale

    def rotary(self, positions, dtype):
        return tuple(t.to(dtype) for t in self.head.rotary.lookup(positions, dtype))  # [T, 1, D]

    def first_state(self, features):
        return self.head.fc(features)  # [B, T, 3 H_target] -> [B, T, H]

    def heads(self, embed, state, cos_sin):
        layer, attn = self.head.midlayer, self.head.midlayer.self_attn
        batch, tokens, _ = embed.shape
        normed = layer.hidden_norm(state)
        residual = normed if self.head.config.norm_before_residual else state
        x = torch.cat([layer.input_layernorm(embed), normed], dim=-1)  # [B, T, 2H]
        q = rotate(attn.q_proj(x).view(batch, tokens, attn.num_heads, attn.head_dim), *cos_sin)
        k = rotate(attn.k_proj(x).view(batch, tokens, attn.num_kv_heads, attn.head_dim), *cos_sin)
        v = attn.v_proj(x).view(batch, tokens, attn.num_kv_heads, attn.head_dim)
        return q, k, v, residual

    def finish(self, attended, residual):
        layer = self.head.midlayer
        residual, h = layer.post_attention_layernorm.add_forward(residual, layer.self_attn.o_proj(attended.flatten(2)))
        return residual + layer.mlp(h)  # [B, T, H]

    def logits(self, output):
        return self.head.logits(output)

    def target_ids(self):
        return self.head.target_ids()


class MTPUnroll:
    """Qwen3.5's MTP head: state 0 = the target's final-normed hidden state; a step's output is the head's state
    after mtp.norm (what the LM head reads and the next step is fed); logits by the target's LM head, over its
    whole vocabulary.  The LM head and rotary table are held here, not in the head, so that the head's
    parameters (and checkpoints) are the mtp.* weights alone."""

    def __init__(self, head: MTPHead, lm_head: nn.Module):
        self.head, self.lm_head = head, lm_head
        self.attn = head.layers[0].self_attn
        self.scale = self.attn.scale
        self.table: PartialRotary | None = None  # set by rotary()

    def rotary(self, positions, dtype):
        """The table for positions 0..T-1, kept for heads() (built per batch: T x rot, where the target's spans
        max_position_embeddings)."""
        self.table = PartialRotary(self.head.config.layer, len(positions)).to(positions.device)
        return self.table.lookup(positions, dtype)  # [T, 1, rot]

    def first_state(self, features):
        return features  # [B, T, H]: the head norms it itself

    def heads(self, embed, state, cos_sin):
        head, layer = self.head, self.head.layers[0]
        x = head.fc(torch.cat([head.pre_fc_norm_embedding(embed), head.pre_fc_norm_hidden(state)], dim=-1))
        q, k, v, gate = self.attn.heads(layer.input_layernorm(x), self.table, cos_sin)
        return q, k, v, (x, gate)  # x [B, T, H]: the layer's residual stream

    def finish(self, attended, carry):
        x, gate = carry
        layer = self.head.layers[0]
        x, h = layer.post_attention_layernorm.add_forward(x, self.attn.output(attended, gate))
        return self.head.norm(x + layer.mlp(h))  # [B, T, H]

    def logits(self, output):
        return self.lm_head(output.to(self.lm_head.weight.dtype))  # [B, T, V]; a bf16 target's head on CUDA

    def target_ids(self):
        return None
