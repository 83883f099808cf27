"""The decoder-only transformer behind Qwen3ForCausalLM and LlamaForCausalLM.

Module names follow the Hugging Face checkpoints (``model.layers.N.self_attn.q_proj`` ...), so a
safetensors state dict loads as is.  The two architectures differ only in Qwen3's per-head RMSNorm
of queries and keys before the rotary embedding.
"""

from __future__ import annotations

import torch
from torch import nn

from specdec.models.attention import AttentionBatch, paged_attention, write_kv
from specdec.models.config import ModelConfig
from specdec.models.fused_linear import FusedProjection, fuse
from specdec.models.fused import Kernels
from specdec.models.layers import GatedMLP, RMSNorm, Rotary

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (k [slots, Hkv, D], v [slots, Hkv, D])


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.qkv: FusedProjection | None = None  # set by fuse_projections()

    def fuse_projections(self) -> bool:
        """One GEMM for q, k and v (specdec.models.fused_linear; idempotent); returns whether they are fused."""
        if self.qkv is None or not self.qkv.valid():
            self.qkv = fuse([self.q_proj, self.k_proj, self.v_proj])
        return self.qkv is not None

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> q [T, H*D], k [T, Hkv*D], v [T, Hkv*D]."""
        if self.qkv is not None:
            return tuple(self.qkv(x))
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def head_views(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> the projections as heads: q [T, H, D], k, v [T, Hkv, D] (views, not normed)."""
        tokens = x.shape[0]
        q, k, v = self.project(x)
        return (q.view(tokens, self.num_heads, self.head_dim), k.view(tokens, self.num_kv_heads, self.head_dim),
                v.view(tokens, self.num_kv_heads, self.head_dim))

    def heads(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]):
        """x [T, hidden] -> q [T, H, D], k [T, Hkv, D] (normed where Qwen3 norms them, rotated), v [T, Hkv, D]."""
        q, k, v = self.head_views(x)
        if self.qk_norm:  # per-head RMSNorm and the rotary embedding in one pass each
            q = self.q_norm.rotate_forward(q, cos_sin)
            k = self.k_norm.rotate_forward(k, cos_sin)
        else:
            q, k = Rotary.forward(q, k, cos_sin)
        return q, k, v

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], batch: AttentionBatch,
                kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [T, hidden] (normed) -> attention output [T, H, D], this step's keys and values written to the cache:
        by Kernels.qk_rope_write in one launch where it is set and takes the layer, else heads() and attend()
        (also inside torch.compile, which fuses those itself)."""
        k_cache = kv_cache[0]
        if not writer_applies(x.dtype, k_cache, cos_sin[0]):
            return self.attend(*self.heads(x, cos_sin), batch, kv_cache)
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else (None, None, 0.0)
        q = Kernels.qk_rope_write(*self.head_views(x), *norms, *cos_sin, batch.slot_mapping, k_cache, kv_cache[1])
        return paged_attention(q, k_cache, kv_cache[1], batch, self.scale)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch,
               kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Write this step's keys/values to the cache and attend: -> [T, H, D]."""
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, k, v, batch.slot_mapping)
        return paged_attention(q, k_cache, v_cache, batch, self.scale)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """[T, H, D] -> [T, hidden]."""
        return self.o_proj(out.reshape(out.shape[0], self.num_heads * self.head_dim))


def writer_applies(dtype: torch.dtype, k_cache: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether an attention layer writes through Kernels.qk_rope_write: it is set (a GPU's fused kernels), the
    step is not traced by torch.compile (which fuses the plain pieces itself), and the kernel takes a layer of
    this dtype, cache and rotation."""
    if Kernels.qk_rope_write is None or torch.compiler.is_compiling():
        return False
    from specdec.kernels.qk_rope_write import supports  # (triton is there: the writer is set)

    return supports(dtype, k_cache, cos)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)


class DecoderBody(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """forward(input_ids [T], positions [T], batch, kv_caches, logits_index [N]) -> logits [N, V]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.rotary = Rotary(config, config.max_position_embeddings)
        self.model = DecoderBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.features: torch.Tensor | None = None  # [rows, F]: see capture_features
        self._feature_columns: dict[int, list[int]] = {}  # layer id -> its column blocks in `features`

    def capture_features(self, layer_ids: tuple[int, ...], max_rows: int) -> None:
        """From now on every forward also writes, for each fed token, the residual stream entering each of
        these layers into self.features [rows, len(layer_ids) * hidden] (row i: the step's token i, in the
        order the forward fed them).  Layer id j counts as transformers' hidden_states[j] and vLLM's
        auxiliary layer ids do: 0 is the embedding, j the output of layer j - 1, and the last, j =
        num_hidden_layers, the final-normed state the LM head reads (as transformers' hidden_states[-1]: what
        an MTP head reads).  A CUDA graph captured after this call writes them too; the buffer holds max_rows
        tokens (grown by eager steps that feed more)."""
        bad = [j for j in layer_ids if not 0 <= j <= self.config.num_hidden_layers]
        if bad:
            raise ValueError(f"feature layer ids {bad} out of range [0, {self.config.num_hidden_layers}]")
        weight = self.model.embed_tokens.weight
        self._feature_columns = {}
        for column, j in enumerate(layer_ids):
            self._feature_columns.setdefault(j, []).append(column)
        self.features = torch.zeros(max_rows, len(layer_ids) * self.config.hidden_size, dtype=weight.dtype,
                                    device=weight.device)

    def keep_feature(self, layer: int, x: torch.Tensor) -> None:
        """x [T, hidden], the residual stream entering `layer` (at num_hidden_layers: the final-normed state):
        copied into self.features if it is asked for."""
        columns = self._feature_columns.get(layer)
        if columns is None:
            return
        tokens, hidden = x.shape
        if tokens > self.features.shape[0] and not _capturing(x.device):
            self.features = self.features.new_zeros(tokens, self.features.shape[1])
        for c in columns:
            self.features[:tokens, c * hidden:(c + 1) * hidden].copy_(x)

    def fuse_projections(self) -> bool:
        """One GEMM for q/k/v and one for gate/up in every layer (``specdec.models.fused_linear``); the
        weights become views into the fused tensors.  Idempotent; returns whether every layer is fused."""
        done = True
        for layer in self.model.layers:
            done = layer.self_attn.fuse_projections() & layer.mlp.fuse_projections() & done
        return done

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                      kv_caches: KVCaches) -> torch.Tensor:
        """[T] ids -> [T, hidden] final-normed hidden states.

        The same pieces as a piecewise step (engine/piecewise.py), which replays everything between two
        attentions as a CUDA graph: embed_piece, then per layer heads -> attend -> post_attention_piece."""
        x, h, cos_sin = self.embed_piece(input_ids, positions)
        for i, kv_cache in enumerate(kv_caches):
            self.keep_feature(i, x)
            attn = self.model.layers[i].self_attn
            x, h = self.post_attention_piece(i, x, attn(h, cos_sin, batch, kv_cache))
        self.keep_feature(len(kv_caches), h)  # the final feature
        return h

    def embed_piece(self, input_ids: torch.Tensor, positions: torch.Tensor):
        """-> the residual stream x [T, hidden], the first layer's input norm of it, cos/sin [T, 1, D]."""
        x = self.model.embed_tokens(input_ids)
        return x, self.model.layers[0].input_layernorm(x), self.rotary.lookup(positions, x.dtype)

    def post_attention_piece(self, i: int, x: torch.Tensor, attended: torch.Tensor):
        """Layer i from its attention output [T, H, D] on: -> (x, the next layer's input norm of x, or the
        final norm after the last layer).  Each residual add is fused with the norm that follows it."""
        layers = self.model.layers
        layer = layers[i]
        x, h = layer.post_attention_layernorm.add_forward(x, layer.self_attn.output(attended))
        next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
        return next_norm.add_forward(x, layer.mlp(h))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                kv_caches: KVCaches, logits_index: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.hidden_states(input_ids, positions, batch, kv_caches)
        if logits_index is not None:
            hidden = hidden[logits_index]
        return self.lm_head(hidden)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
