"""How a twin's weights are made from a small model's (docs/TWINS.md; specdec/models/twin.py builds the twin):
where each small head and head dimension lands in the twin (head_dim_map, grouped_head_map, head_rows) and the
Builder that pads the parts of a Qwen3 layer, which twin_qwen3_5.HybridBuilder extends with Gated DeltaNet
layers."""

from __future__ import annotations

import math

import torch

from specdec.models.config import ModelConfig


def head_dim_map(small_d: int, big_d: int, small_rot: int | None = None, big_rot: int | None = None) -> torch.Tensor:
    """[d] twin head dimension of each small head dimension, keeping the rotary pairs and frequencies.

    The first r (small_rot, default d) dims are rotated in rotate-half pairs (i, i + r/2) at frequency
    theta^(-2i/r); with s = R/r, small pair i becomes twin pair s*i, of frequency theta^(-2si/R): the same.
    Unrotated dims follow R with stride (D - R) / (d - r).  Example, d = 8, r = 4, D = 16, R = 8 (s = 2):
    rotary [0, 1 | 2, 3] -> [0, 2 | 4, 6]; unrotated [4, 5, 6, 7] -> 8 + 2 * [0, 1, 2, 3] = [8, 10, 12, 14]."""
    r, big_r = small_rot or small_d, big_rot or big_d
    half, scale = r // 2, big_r // r
    stride = (big_d - big_r) // (small_d - r) if small_d > r else 1
    i = torch.arange(small_d)
    rotated = torch.where(i < half, scale * i, big_r // 2 + scale * (i - half))
    return torch.where(i < r, rotated, big_r + stride * (i - r))


def grouped_head_map(heads: int, small_group: int, big_group: int) -> torch.Tensor:
    """[heads] twin head of each small head when heads come in groups sharing one kv (or key) head: head j of
    group g = j // small_group becomes g * big_group + j % small_group.  Example, 4 heads in groups of 2 into
    groups of 3: [0, 1, 2, 3] -> [0, 1, 3, 4]."""
    j = torch.arange(heads)
    return (j // small_group) * big_group + j % small_group


def q_head_map(small: ModelConfig, big: ModelConfig) -> torch.Tensor:
    return grouped_head_map(small.num_attention_heads, small.num_query_groups, big.num_query_groups)


def head_rows(heads: torch.Tensor, dims: torch.Tensor, big_d: int) -> torch.Tensor:
    """Flat twin indices (head * D + dim) of every small (head, dim), head-major: [heads * d]."""
    return (heads[:, None] * big_d + dims[None, :]).reshape(-1)


class Padding:
    """What every twin builder starts from: the small module's weights, read in float32, and new weights filled
    with zeros or, given noise, N(0, noise^2) from a seeded generator."""

    def __init__(self, small: torch.nn.Module, noise: float, device):
        self.s, self.noise, self.device = small, noise, device
        self.gen = torch.Generator(device=device).manual_seed(0)

    def fill(self, shape) -> torch.Tensor:
        t = torch.zeros(shape, device=self.device, dtype=torch.float32)
        if self.noise:
            t.normal_(0.0, self.noise, generator=self.gen)
        return t

    def small(self, name: str) -> torch.Tensor:
        return self.s.get_parameter(name).detach().to(self.device, torch.float32)


class Builder(Padding):
    """Pads the parts one layer is made of.  Methods take the small weight's name prefix `src` and the twin's
    `dst` (the same for a model; an MTP head's small weights come from its own module)."""

    def __init__(self, small: torch.nn.Module, small_config: ModelConfig, big_config: ModelConfig, noise: float,
                 device, dtype):
        super().__init__(small, noise, device)
        self.sc, self.bc, self.dtype = small_config, big_config, dtype
        s, b = self.sc, self.bc
        self.dmap = head_dim_map(s.head_dim, b.head_dim, s.rotary_dim, b.rotary_dim).to(device)
        q_heads = q_head_map(s, b).to(device)
        self.q_rows = head_rows(q_heads, self.dmap, b.head_dim)  # [Q d]: attention output columns
        # a gated q_proj reads each head's query and gate side by side: [Q', 2D], gate dim i at D + dmap[i]
        self.q_proj_rows = head_rows(q_heads, torch.cat([self.dmap, b.head_dim + self.dmap]), 2 * b.head_dim) \
            if s.attn_output_gate else self.q_rows
        self.kv_rows = head_rows(torch.arange(s.num_key_value_heads, device=device), self.dmap, b.head_dim)
        self.h = s.hidden_size
        self.norm_scale = math.sqrt(s.hidden_size / b.hidden_size)
        self.centred = s.zero_centred_norm  # Qwen3.5's RMSNorm scales by (1 + w)

    def linear(self, name: str, rows: torch.Tensor | slice, cols: torch.Tensor | slice, shape, zero_rows=()):
        w = self.fill(shape)
        w[rows, cols] = self.small(name)  # rows: index tensor or slice; cols: slice
        for r in zero_rows:
            w[r] = 0.0
        return w

    def norm_weight(self, small_weight: torch.Tensor, scale: float) -> torch.Tensor:
        """The stored weight whose scale is `scale` times the small one's (1 + w when zero-centred)."""
        return (1.0 + small_weight) * scale - 1.0 if self.centred else small_weight * scale

    def stored_scale(self, scale: float) -> float:
        """The stored weight of a norm dimension that should scale by `scale`."""
        return scale - 1.0 if self.centred else scale

    def hidden_norm(self, src: str, dst: str, out: dict, constant_scale: float = 0.0) -> None:
        """A norm over the residual stream: real dims scaled by sqrt(h/H), dimension h by `constant_scale`."""
        w = self.fill(self.bc.hidden_size)
        w[:self.h] = self.norm_weight(self.small(src), self.norm_scale)
        w[self.h] = self.stored_scale(constant_scale)
        out[dst] = w

    def writer(self, src: str, dst: str, cols: torch.Tensor | slice, width: int, out: dict) -> None:
        """An output projection into the residual stream [H, width]: real rows and `cols`, row h exactly zero."""
        w = self.fill((self.bc.hidden_size, width))
        w[:self.h, cols] = self.small(src)
        w[self.h] = 0.0
        out[dst] = w

    def attention(self, src: str, dst: str, out: dict) -> None:
        b, s, real = self.bc, self.sc, slice(0, self.h)
        qdim, kvdim = b.num_attention_heads * b.head_dim, b.num_key_value_heads * b.head_dim
        q_width = qdim * (2 if b.attn_output_gate else 1)
        out[dst + "q_proj.weight"] = self.linear(src + "q_proj.weight", self.q_proj_rows, real, (q_width, b.hidden_size))
        for name in ("k_proj", "v_proj"):
            out[dst + name + ".weight"] = self.linear(src + name + ".weight", self.kv_rows, real, (kvdim, b.hidden_size))
        self.writer(src + "o_proj.weight", dst + "o_proj.weight", self.q_rows, qdim, out)
        # per-head norms over D instead of d scale q and k by sqrt(D/d); 1/sqrt(D) takes one sqrt(D/d) back
        q_norm, k_norm = self.fill(b.head_dim), self.fill(b.head_dim)
        q_norm[self.dmap] = self.norm_weight(self.small(src + "q_norm.weight"), 1.0)
        k_norm[self.dmap] = self.norm_weight(self.small(src + "k_norm.weight"), math.sqrt(s.head_dim / b.head_dim))
        out[dst + "q_norm.weight"], out[dst + "k_norm.weight"] = q_norm, k_norm

    def mlp(self, src: str, dst: str, out: dict) -> None:
        b, m = self.bc, self.sc.intermediate_size
        for name in ("gate_proj", "up_proj"):
            out[dst + name + ".weight"] = self.linear(src + name + ".weight", slice(0, m), slice(0, self.h),
                                                      (b.intermediate_size, b.hidden_size))
        self.writer(src + "down_proj.weight", dst + "down_proj.weight", slice(0, m), b.intermediate_size, out)

    def block(self, src: str, dst: str, out: dict) -> None:
        """A real layer's norms and MLP (the token mixer is the caller's)."""
        for name in ("input_layernorm", "post_attention_layernorm"):
            self.hidden_norm(src + name + ".weight", dst + name + ".weight", out)  # the constant never feeds a layer
        self.mlp(src + "mlp.", dst + "mlp.", out)

    def layer(self, i: int, out: dict) -> None:
        p, b, s = f"model.layers.{i}.", self.bc, self.sc
        qdim, kvdim = b.num_attention_heads * b.head_dim, b.num_key_value_heads * b.head_dim
        if i >= s.num_hidden_layers:  # identity block: reads anything, writes exact zeros
            for name, shape in (("self_attn.q_proj", (qdim, b.hidden_size)), ("self_attn.k_proj", (kvdim, b.hidden_size)),
                                ("self_attn.v_proj", (kvdim, b.hidden_size)), ("mlp.gate_proj", (b.intermediate_size, b.hidden_size)),
                                ("mlp.up_proj", (b.intermediate_size, b.hidden_size))):
                out[p + name + ".weight"] = self.fill(shape)
            out[p + "self_attn.o_proj.weight"] = torch.zeros(b.hidden_size, qdim, device=self.device)
            out[p + "mlp.down_proj.weight"] = torch.zeros(b.hidden_size, b.intermediate_size, device=self.device)
            for name, dim in (("input_layernorm", b.hidden_size), ("post_attention_layernorm", b.hidden_size),
                              ("self_attn.q_norm", b.head_dim), ("self_attn.k_norm", b.head_dim)):
                out[p + name + ".weight"] = torch.ones(dim, device=self.device)
            return
        self.attention(p + "self_attn.", p + "self_attn.", out)
        self.block(p, p, out)

    def layers(self, out: dict, twin: torch.nn.Module) -> None:
        """Every layer of the twin (`twin`: the twin on the meta device, for its shapes)."""
        for i in range(self.bc.num_hidden_layers):
            self.layer(i, out)

    def vocab(self, out: dict, c: float, u: float) -> None:
        b, s, h = self.bc, self.sc, self.h
        emb = self.fill((b.vocab_size, b.hidden_size))
        emb[:s.vocab_size, :h] = self.small("model.embed_tokens.weight")
        emb[:s.vocab_size, h] = c
        head = emb if b.tie_word_embeddings else self.fill((b.vocab_size, b.hidden_size))
        if not b.tie_word_embeddings:
            head[:s.vocab_size, :h] = self.small("lm_head.weight")
            head[:s.vocab_size, h] = 0.0
        head[s.vocab_size:, :] = 0.0
        head[s.vocab_size:, h] = -u
        if not b.tie_word_embeddings:
            out["lm_head.weight"] = head
        out["model.embed_tokens.weight"] = emb
        self.hidden_norm("model.norm.weight", "model.norm.weight", out, constant_scale=1.0)  # passes c on


class CastingDict(dict):
    """A state dict that casts each weight to dtype as it is stored (peak memory: the twin + one float32 matrix)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def __setitem__(self, key, value: torch.Tensor):
        super().__setitem__(key, value.to(self.dtype))
