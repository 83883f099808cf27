"""Scaled twins: a small trained model padded to a large model's exact shapes, computing the same function.

The twin has the large model's memory traffic, kernels and KV cache (its step cost is real) while its
outputs are the small model's (its acceptance is real).  Construction, for a small Qwen3 model with
hidden size h, head size d, q/kv heads Q/K, MLP width m, L layers and vocabulary V padded to H, D, Q', K',
M, L', V' (see docs/TWINS.md for the derivation):

- residual stream: the small model's h dimensions come first; dimension h carries a small constant c
  (from the embedding, never written by any layer); every other padded dimension stays zero.
- RMSNorm over H instead of h scales the real dimensions by sqrt(H/h): the twin's norm weights are the
  small ones times sqrt(h/H) (c adds c^2/S ~ 1e-6 relative to the mean square, below float32 noise).
- heads: small q head j of kv group g is twin head g*(Q'/K') + j % (Q/K); kv group g stays g.
  Head dimension i maps to s*i in each rotary half (s = D/d), which keeps RoPE frequencies
  (theta^(-2si/D) = theta^(-2i/d)); q_norm keeps its weights and k_norm's are scaled by sqrt(d/D) so
  that q.k / sqrt(D) equals the small model's q.k / sqrt(d).
- extra heads, MLP neurons and layers read anything but write nothing: their output-projection
  columns (o_proj, down_proj) are zero, so extra layers are identity blocks.
- padded vocabulary: the final norm maps dimension h to w_p c / rms > 0 and padded tokens' output
  rows are -u e_h, a logit below every real one by a calibrated margin (probability < 1e-9).

`noise` fills every structurally-zero weight with N(0, noise^2) instead: a zero matrix can run faster
than a dense one when compute-bound, so benchmark twins use noise ~1e-6 to cost what real weights cost.
Exactly-zero entries that keep the function (output rows of the constant dimension, extra layers'
output projections) stay zero.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from specdec.errors import ConfigError
from specdec.models.config import ModelConfig
from specdec.models.loader import Model, _attach_rotary, model_class
from specdec.models.transformer import CausalLM

SHAPES = {  # the public Qwen3 configurations' shapes
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    # Qwen3.5-27B's text model (docs/TWINS.md gives the sources); rope_theta and M-RoPE stay the small model's
    "qwen3.5-27b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
                        num_key_value_heads=4, head_dim=256, partial_rotary_factor=0.25, linear_num_key_heads=16,
                        linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                        linear_conv_kernel_dim=4, layer_types=(("linear_attention",) * 3 + ("full_attention",)) * 16,
                        vocab_size=248320, tie_word_embeddings=False),
}
LOGIT_MARGIN = 60.0  # padded-vocabulary logits sit at least this far below the real ones
CONSTANT_SCALE = 1e-3  # c relative to the smallest embedding norm


def twin_config(small: ModelConfig, shape: dict) -> ModelConfig:
    big = dataclasses.replace(small, **shape)
    # RMSNorm over H dims of which h are real: mean square shrinks by h/H, so eps shrinks with it
    # (exact for the hidden norms; q/k norms shrink by d/D and keep a relative eps error below 1e-5)
    big = dataclasses.replace(big, rms_norm_eps=small.rms_norm_eps * small.hidden_size / big.hidden_size)
    problems = []
    if big.architecture not in ("qwen3", "qwen3_5"):
        problems.append("only Qwen3 and Qwen3.5 models have twins so far")
    if big.hidden_size < small.hidden_size + 1:
        problems.append("the twin's hidden size must exceed the model's by at least 1")
    for name in ("intermediate_size", "num_hidden_layers", "vocab_size", "num_key_value_heads"):
        if getattr(big, name) < getattr(small, name):
            problems.append(f"{name} {getattr(big, name)} < {getattr(small, name)}")
    if big.num_query_groups < small.num_query_groups:
        problems.append(f"query heads per kv head {big.num_query_groups} < {small.num_query_groups}")
    if big.tie_word_embeddings and not small.tie_word_embeddings:
        problems.append("a twin with tied embeddings needs a model with tied embeddings")
    if big.rotary_dim % small.rotary_dim or big.head_dim - big.rotary_dim < small.head_dim - small.rotary_dim:
        problems.append(f"head_dim {big.head_dim} (rotary {big.rotary_dim}) is not a multiple of {small.head_dim} "
                        f"(rotary {small.rotary_dim}) with room for its unrotated dims")
    if big.is_hybrid and small.architecture != "qwen3_5":
        problems.append("a Qwen3.5 shape needs a Qwen3.5 model")
    if big.architecture == "qwen3_5":
        from specdec.models.twin_qwen3_5 import hybrid_problems

        problems += hybrid_problems(small, big, shape)
    if problems:
        raise ConfigError("cannot build this twin: " + "; ".join(problems))
    return big


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


def _rows(heads: torch.Tensor, dims: torch.Tensor, big_d: int) -> torch.Tensor:
    """Flat twin indices (head * D + dim) of every small (head, dim), head-major: [heads * d]."""
    return (heads[:, None] * big_d + dims[None, :]).reshape(-1)


class _Builder:
    """Pads the parts one layer is made of.  Methods take the small weight's name prefix `src` and the twin's
    `dst` (the same for a model; an MTP head's small weights come from its own module)."""

    def __init__(self, small: torch.nn.Module, small_config: ModelConfig, big_config: ModelConfig, noise: float,
                 device, dtype):
        self.s, self.sc, self.bc = small, small_config, big_config
        self.noise, self.device, self.dtype = noise, device, dtype
        self.gen = torch.Generator(device=device).manual_seed(0)
        s, b = self.sc, self.bc
        self.dmap = head_dim_map(s.head_dim, b.head_dim, s.rotary_dim, b.rotary_dim).to(device)
        q_heads = q_head_map(s, b).to(device)
        self.q_rows = _rows(q_heads, self.dmap, b.head_dim)  # [Q d]: attention output columns
        # a gated q_proj reads each head's query and gate side by side: [Q', 2D], gate dim i at D + dmap[i]
        self.q_proj_rows = _rows(q_heads, torch.cat([self.dmap, b.head_dim + self.dmap]), 2 * b.head_dim) \
            if s.attn_output_gate else self.q_rows
        self.kv_rows = _rows(torch.arange(s.num_key_value_heads, device=device), self.dmap, b.head_dim)
        self.h = s.hidden_size
        self.norm_scale = math.sqrt(s.hidden_size / b.hidden_size)
        self.centred = s.zero_centred_norm  # Qwen3.5's RMSNorm scales by (1 + w)

    def fill(self, shape) -> torch.Tensor:
        t = torch.zeros(shape, device=self.device, dtype=torch.float32)
        if self.noise:
            t.normal_(0.0, self.noise, generator=self.gen)
        return t

    def small(self, name: str) -> torch.Tensor:
        return self.s.get_parameter(name).detach().to(self.device, torch.float32)

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


@torch.no_grad()
def final_rms_bound(small: Model, calibration: list[list[int]]) -> float:
    """The largest RMS of the small model's final residual stream over the calibration sequences."""
    from specdec.engine.engine import Engine, EngineConfig

    captured: list[float] = []
    norm = small.model.norm
    original = norm.add_forward

    def recording(x, delta):  # the final residual stream is the final norm's input
        out = original(x, delta)
        captured.append(out[0].float().pow(2).mean(-1).sqrt().max().item())
        return out

    def pre_hook(module, args):  # a hybrid model calls its final norm on the final residual stream itself
        captured.append(args[0].float().pow(2).mean(-1).sqrt().max().item())

    norm.add_forward = recording
    hook = norm.register_forward_pre_hook(pre_hook)
    try:
        engine = Engine(small, EngineConfig(kv_cache_tokens=4096, max_num_seqs=4, static_shapes=False))
        for ids in calibration:
            engine.all_logits(ids[: small.config.max_position_embeddings - 1])
    finally:
        del norm.add_forward
        hook.remove()
    return max(captured)


@torch.no_grad()
def make_twin(small: Model, shape: str | dict, noise: float = 0.0, device=None, dtype=None,
              calibration: list[list[int]] | None = None) -> Model:
    """The twin of `small` (a Qwen3 CausalLM or a Qwen3.5 HybridCausalLM) at `shape` (a name in SHAPES or a dict
    of config fields), on `device`."""
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise ConfigError(f"unknown twin shape {shape!r}: use one of {', '.join(SHAPES)} or a config dict")
        shape = SHAPES[shape]
    device = torch.device(device or small.lm_head.weight.device)
    dtype = dtype or small.lm_head.weight.dtype
    big_config = twin_config(small.config, shape)
    with torch.device("meta"):
        twin = model_class(big_config)(big_config)
    builder = _builder_class(big_config)(small, small.config, big_config, noise, device, dtype)
    c, u = _vocab_constants(small, big_config, calibration)
    state = _CastingDict(dtype)  # each weight is cast as it is made: peak memory ~ the twin + one fp32 matrix
    builder.vocab(state, c, u)
    builder.layers(state, twin)
    twin.load_state_dict(state, strict=False, assign=True)
    if big_config.tie_word_embeddings:
        twin.lm_head.weight = twin.model.embed_tokens.weight
    _attach_rotary(twin, big_config, device)
    return twin.eval().requires_grad_(False)


def _builder_class(config: ModelConfig) -> type[_Builder]:
    if config.architecture == "qwen3_5":
        from specdec.models.twin_qwen3_5 import HybridBuilder

        return HybridBuilder
    return _Builder


class _CastingDict(dict):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def __setitem__(self, key, value: torch.Tensor):
        super().__setitem__(key, value.to(self.dtype))


def _vocab_constants(small: Model, big: ModelConfig, calibration) -> tuple[float, float]:
    """c (the constant dimension's value) and u (the padded tokens' output weight)."""
    emb = small.model.embed_tokens.weight.detach().float()
    c = CONSTANT_SCALE * emb.norm(dim=-1).min().item()
    if calibration is None:
        gen = torch.Generator().manual_seed(0)
        calibration = [torch.randint(0, small.config.vocab_size, (256,), generator=gen).tolist() for _ in range(4)]
    rms = final_rms_bound(small, calibration) * math.sqrt(small.config.hidden_size / big.hidden_size)
    # padded logit = -u * c / rms' (w_p = 1); real logits are above -LOGIT_MARGIN... with a 10x safety factor
    u = 10 * LOGIT_MARGIN * max(rms, 1e-6) / c
    return c, u


def save_twin(twin: CausalLM, source_dir, out_dir) -> None:
    """Write the twin as a Hugging Face directory (config.json, sharded safetensors, the source's tokenizer)."""
    import json
    import shutil
    from pathlib import Path

    from safetensors.torch import save_file

    source_dir, out_dir = Path(source_dir), Path(out_dir)
    check_savable(twin.config)
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = json.loads((source_dir / "config.json").read_text())
    c = twin.config
    raw.update(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
               num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
               head_dim=c.head_dim, vocab_size=c.vocab_size, tie_word_embeddings=c.tie_word_embeddings,
               rms_norm_eps=c.rms_norm_eps)
    raw.pop("layer_types", None)
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2))
    state = {k: v.contiguous() for k, v in twin.state_dict().items()}
    if c.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_sharded(state, out_dir, save_file)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        if (source_dir / name).is_file():
            shutil.copy(source_dir / name, out_dir / name)


def check_savable(config: ModelConfig) -> None:
    """Refuse to write a Qwen3.5 twin: its per-head norms carry their own eps (twin_qwen3_5.exact_eps), which
    config.json's one rms_norm_eps cannot hold, so a saved copy would not compute the small model's function."""
    if config.architecture == "qwen3_5":
        raise ConfigError("Qwen3.5 twins are built in memory only (LLM(model, twin=SHAPE) / --twin SHAPE): their "
                          "per-head norms need eps values config.json cannot hold")


def save_sharded(state: dict, out_dir, save_file, shard_bytes: int = 2 << 30) -> None:
    """model.safetensors, or model-0000i-of-0000n.safetensors shards plus their index when large."""
    import json

    shards: list[dict] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    (out_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
