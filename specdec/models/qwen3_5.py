"""Qwen3.5's hybrid dense text model: Gated DeltaNet linear-attention layers (specdec/models/gated_deltanet.py)
and gated full-attention layers, in the order config.layer_types gives.

Module names follow the Hugging Face text checkpoint (model.layers.N.linear_attn.* / self_attn.*, mlp,
input_layernorm, post_attention_layernorm, model.norm, lm_head), so a state dict loads as is.  What differs
from Qwen3 (specdec/models/transformer.py):
  - every RMSNorm but the DeltaNet's gated one is zero-centred: y = x / rms(x) * (1 + w), in float32;
  - full attention: q_proj reads each head's query and output gate side by side ([T, H, 2D]: query dims
    0..D-1, gate D..2D-1); out = attention * sigmoid(gate); only the first rotary_dim dims of q and k are
    rotated (partial_rotary_factor), the rest pass through;
  - M-RoPE: for text the three position axes are equal, so it is plain RoPE over the rotary dims.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from specdec.models.attention import AttentionBatch, paged_attention, write_kv
from specdec.models.config import ModelConfig
from specdec.models.fused import Kernels
from specdec.models.fused_linear import FusedProjection, fuse
from specdec.models.gated_deltanet import GatedDeltaNet, GatedRMSNorm, SequenceGroup, plan_groups
from specdec.models.layers import GatedMLP, rope_inverse_frequencies
from specdec.models.transformer import CausalLM, KVCaches, writer_applies


class ZeroCentredRMSNorm(nn.Module):
    """y = x / rms(x) * (1 + w), in float32 and cast back (the weight starts at zero)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] -> normalised, x's dtype."""
        return Kernels.zero_centred_rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, norm(x + delta))."""
        return Kernels.add_zero_centred_rms_norm(x, delta, self.weight, self.eps)


class PartialRotary(nn.Module):
    """Rotary embedding of the first rotary_dim dims of each head (rotate-half layout) over a cos/sin table
    indexed by absolute position; the remaining head dims pass through."""

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        self.dim = config.rotary_dim
        inv_freq = rope_inverse_frequencies(dataclasses.replace(config, head_dim=self.dim))  # [rot / 2]
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # [P, rot / 2]
        table = torch.cat([freqs, freqs], dim=-1)  # [P, rot]
        self.register_buffer("cos", table.cos(), persistent=False)
        self.register_buffer("sin", table.sin(), persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, rot] for positions [T] (once per forward, shared by the attention layers)."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)

    def apply(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [T, heads, D] -> x with dims 0..rot-1 rotated."""
        cos, sin = cos_sin
        if self.dim == x.shape[-1]:
            return Kernels.rotate(x, cos, sin)
        return torch.cat([Kernels.rotate(x[..., :self.dim], cos, sin), x[..., self.dim:]], dim=-1)


class GatedAttention(nn.Module):
    """Full attention over the paged KV cache with per-head zero-centred q/k norms, partial rotary and a
    sigmoid output gate: forward(x [T, hidden], ...) -> [T, hidden]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.gated = c.attn_output_gate
        self.scale = self.head_dim**-0.5
        width = self.num_heads * self.head_dim
        bias = c.attention_bias
        self.q_proj = nn.Linear(c.hidden_size, width * (2 if self.gated else 1), bias=bias)
        self.k_proj = nn.Linear(c.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(c.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(width, c.hidden_size, bias=bias)
        self.q_norm = ZeroCentredRMSNorm(self.head_dim, c.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(self.head_dim, c.rms_norm_eps)
        self.qkv: FusedProjection | None = None  # set by fuse_projections()

    def fuse_projections(self) -> bool:
        if self.qkv is None or not self.qkv.valid():
            self.qkv = fuse([self.q_proj, self.k_proj, self.v_proj])
        return self.qkv is not None

    def head_views(self, x: torch.Tensor):
        """x [..., T, hidden] -> the projections as heads (views, not normed): q [..., T, H, D], k, v
        [..., T, Hkv, D], gate [..., T, H, D] or None (a gated q_proj lays each head's query beside its gate)."""
        lead = x.shape[:-1]
        q, k, v = self.qkv(x) if self.qkv is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        gate = None
        if self.gated:  # per head: [query | gate], each head_dim wide
            q, gate = q.view(*lead, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)  # [..., H, D] each
        return (q.reshape(*lead, self.num_heads, self.head_dim), k.view(*lead, self.num_kv_heads, self.head_dim),
                v.view(*lead, self.num_kv_heads, self.head_dim), gate)

    def heads(self, x: torch.Tensor, rotary: PartialRotary, cos_sin: tuple[torch.Tensor, torch.Tensor]):
        """x [..., T, hidden] -> (q [..., T, H, D], k, v [..., T, Hkv, D], gate [..., T, H, D] or None): q and k
        normed and rotated (cos_sin [T, 1, rot]).  Any leading dims: the training-time test runs [B, T]."""
        q, k, v, gate = self.head_views(x)
        return rotary.apply(self.q_norm(q), cos_sin), rotary.apply(self.k_norm(k), cos_sin), v, gate

    def output(self, attended: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """attended [..., H, D] (times sigmoid(gate) when gated) -> o_proj -> [..., hidden]."""
        if gate is not None:
            attended = attended * torch.sigmoid(gate)
        return self.o_proj(attended.flatten(-2))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch,
               kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Write this step's keys/values to the cache and attend (the shape-dependent part): -> [T, H, D]."""
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, k, v, batch.slot_mapping)
        return paged_attention(q, k_cache, v_cache, batch, self.scale)

    def forward(self, x: torch.Tensor, rotary: PartialRotary, cos_sin: tuple[torch.Tensor, torch.Tensor],
                batch: AttentionBatch, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; the q/k norms, rotation and KV writes by Kernels.qk_rope_write in one
        launch where it is set and takes the layer (transformer.Attention.forward's rule), else heads() and
        attend()."""
        k_cache, v_cache = kv_cache
        if not writer_applies(x.dtype, k_cache, cos_sin[0]):
            q, k, v, gate = self.heads(x, rotary, cos_sin)
            return self.output(self.attend(q, k, v, batch, kv_cache), gate)
        q, k, v, gate = self.head_views(x)  # the kernel reads a gated query in place, beside its gate
        q = Kernels.qk_rope_write(q, k, v, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, *cos_sin,
                                  batch.slot_mapping, k_cache, v_cache, centred=True)
        return self.output(paged_attention(q, k_cache, v_cache, batch, self.scale), gate)


class HybridDecoderLayer(nn.Module):
    """A token mixer (linear_attn or self_attn, by layer type) and the MLP, each behind a zero-centred norm."""

    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.is_linear = layer_id in config.linear_layer_ids
        self.input_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config, state_index=config.linear_layer_ids.index(layer_id))
        else:
            self.self_attn = GatedAttention(config)
        self.post_attention_layernorm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, batch: AttentionBatch, rotary: PartialRotary | None = None,
                cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
                kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None,
                groups: list[SequenceGroup] = ()) -> torch.Tensor:
        """The residual stream x [T, hidden] -> after this layer [T, hidden].  A linear layer reads groups and
        batch.states; a full-attention one rotary, cos_sin and its kv_cache (the target's and the MTP head's
        layers alike)."""
        h = self.input_layernorm(x)
        if self.is_linear:
            pre = self.pre_mixer(h, rotary, cos_sin)
            mixed = self.post_mixer(self.core(pre, batch, kv_cache, groups), pre)
        else:  # in one piece: GatedAttention.forward may write its keys in the same launch as the norms
            mixed = self.self_attn(h, rotary, cos_sin, batch, kv_cache)
        x, h = self.post_attention_layernorm.add_forward(x, mixed)
        return x + self.mlp(h)

    # The token mixer in three parts: pre_mixer and post_mixer are row-wise (engine/piecewise_hybrid.py replays
    # them inside CUDA graphs), core depends on the step's layout and runs eagerly.

    def pre_mixer(self, h: torch.Tensor, rotary: PartialRotary | None, cos_sin) -> tuple:
        """The normed input h [T, hidden] -> a linear layer's (mixed [T, conv_dim], z [T, Hv*Dv], b, a [T, Hv]),
        a full-attention layer's (q [T, H, D], k, v [T, Hkv, D], gate [T, H, D] or None)."""
        if self.is_linear:
            return self.linear_attn.project(h)
        return self.self_attn.heads(h, rotary, cos_sin)

    def core(self, pre: tuple, batch: AttentionBatch, kv_cache, groups: list[SequenceGroup]) -> torch.Tensor:
        """pre_mixer's outputs -> a linear layer's delta-rule output [T, Hv, Dv] (states advanced or deferred),
        a full-attention layer's attended values [T, H, D] (keys and values written to kv_cache)."""
        if self.is_linear:
            mixed, _, b, a = pre
            return self.linear_attn.core(mixed, b, a, groups, batch.states)
        q, k, v, _ = pre
        return self.self_attn.attend(q, k, v, batch, kv_cache)

    def post_mixer(self, core: torch.Tensor, pre: tuple) -> torch.Tensor:
        """core's output (gated by z or gate from pre) -> the mixer's output [T, hidden]."""
        if self.is_linear:
            return self.linear_attn.output(core, pre[1])
        return self.self_attn.output(core, pre[3])


class HybridBody(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(HybridDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = ZeroCentredRMSNorm(config.hidden_size, config.rms_norm_eps)


class HybridCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], batch, kv_caches, logits_index [N]) -> logits [N, V], as CausalLM.

    kv_caches: one (k_cache, v_cache) per full-attention layer, in layer order (config.attention_layer_ids).
    batch.states: the linear layers' recurrent state (a StateBatch; required when the model has linear
    layers): each sequence's rows batch.query_start[b]:query_start[b + 1] continue the state in its slot."""

    # The EAGLE-3 feature capture reads only config, model.embed_tokens and the features buffer: shared as is.
    capture_features = CausalLM.capture_features
    keep_feature = CausalLM.keep_feature

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.rotary = PartialRotary(config, config.max_position_embeddings)
        self.model = HybridBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.features: torch.Tensor | None = None  # [rows, F]: see capture_features
        self._feature_columns: dict[int, list[int]] = {}

    def fuse_projections(self) -> bool:
        """One GEMM per layer for the token mixer's input projections and one for the MLP's gate/up (the
        weights become views of the fused tensors, as CausalLM.fuse_projections).  Returns whether all fused."""
        done = True
        for layer in self.model.layers:
            mixer = layer.linear_attn if layer.is_linear else layer.self_attn
            done = mixer.fuse_projections() & layer.mlp.fuse_projections() & done
        return done

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                      kv_caches: KVCaches) -> torch.Tensor:
        """[T] ids -> [T, hidden] final-normed hidden states."""
        self._check_inputs(batch, kv_caches)
        x = self.model.embed_tokens(input_ids)
        cos_sin = self.rotary.lookup(positions, x.dtype) if kv_caches else None
        groups: list[SequenceGroup] = plan_groups(batch) if self.config.is_hybrid else []
        caches = iter(kv_caches)
        for i, layer in enumerate(self.model.layers):
            self.keep_feature(i, x)
            x = layer(x, batch, self.rotary, cos_sin, None if layer.is_linear else next(caches), groups)
        hidden = self.model.norm(x)
        self.keep_feature(len(self.model.layers), hidden)  # the final feature: what the LM head reads
        return hidden

    def embed_piece(self, input_ids: torch.Tensor, positions: torch.Tensor):
        """The first piece of a piecewise step (engine/piecewise_hybrid.py): ids, positions [T] -> the residual
        stream x [T, hidden], layer 0's input norm of it, cos/sin [T, 1, rot] (None without attention layers)."""
        x = self.model.embed_tokens(input_ids)
        cos_sin = self.rotary.lookup(positions, x.dtype) if self.config.num_attention_layers else None
        return x, self.model.layers[0].input_layernorm(x), cos_sin

    def post_mixer_piece(self, i: int, x: torch.Tensor, core: torch.Tensor, pre: tuple):
        """Layer i from its mixer's core output on: -> (x, the next layer's input norm of x, or the final norm
        after the last layer).  Each residual add is fused with the norm that follows it."""
        layers = self.model.layers
        layer = layers[i]
        x, h = layer.post_attention_layernorm.add_forward(x, layer.post_mixer(core, pre))
        next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
        return next_norm.add_forward(x, layer.mlp(h))

    def _check_inputs(self, batch: AttentionBatch, kv_caches: KVCaches) -> None:
        want = self.config.num_attention_layers
        if len(kv_caches) != want:
            raise ValueError(f"this hybrid model takes one KV cache per full-attention layer ({want}, layers "
                             f"{list(self.config.attention_layer_ids)}), got {len(kv_caches)}")
        if self.config.is_hybrid and batch.states is None:
            raise ValueError("a hybrid model needs batch.states (a StateBatch with the linear layers' state pools "
                             "and each sequence's slot)")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                kv_caches: KVCaches, logits_index: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.hidden_states(input_ids, positions, batch, kv_caches)
        if logits_index is not None:
            hidden = hidden[logits_index]
        return self.lm_head(hidden)


@torch.no_grad()
def init_random_(model: HybridCausalLM, generator: torch.Generator, std: float) -> None:
    """Random weights as a trained checkpoint would look to the kernels: matrices N(0, std), zero-centred
    norms 0 (scale 1), the gated norm 1, dt_bias 1 and A = exp(A_log) uniform in [0.01, 16] as transformers
    initialises them."""
    for module in model.modules():
        if isinstance(module, ZeroCentredRMSNorm):
            module.weight.zero_()
        elif isinstance(module, GatedRMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, GatedDeltaNet):
            module.dt_bias.fill_(1.0)
            module.A_log.copy_(torch.empty_like(module.A_log).uniform_(0.01, 16.0, generator=generator).log())
        elif isinstance(module, (nn.Linear, nn.Embedding, nn.Conv1d)):
            module.weight.normal_(0.0, std, generator=generator)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
