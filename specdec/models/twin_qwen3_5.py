"""Scaled twins of Qwen3.5 hybrids: the parts specdec/models/twin.py's Qwen3 construction does not cover.

Shared with Qwen3 (twin_builder.py's Builder): the residual stream's constant dimension h, the padded vocabulary, the
MLP, and the full-attention layers, here with Qwen3.5's conventions handled there: zero-centred norms store
w' with (1 + w') = (1 + w) x scale, the gated q_proj's gate dims sit beside the query dims of the same head,
and partial rotary maps the r rotated dims of a head onto the R rotated dims of a twin head (head_dim_map).

Here (docs/TWINS.md derives each):
- layer placement: small layer i goes to the next twin layer of the same type (full or linear attention), in
  order; every other twin layer is an identity block (all output projections exactly zero).
- Gated DeltaNet: key head g stays g, value head j of key group g becomes g * r' + j % r (r, r' value heads per
  key head); within a head, dim i stays i.  The causal conv's channels (q | k | v side by side) follow their
  heads.  Padded channels read nothing (zero rows of in_proj_qkv), so their conv state and their part of the
  recurrent state stay zero: the l2 norms of q and k, and S^T q, are the small ones.  Extra value heads write
  nothing (zero out_proj columns).  With a larger key head dim, q's scale Dk'^-0.5 shrinks the output by
  sqrt(Dk/Dk'), which the gated norm (scale invariant) takes out; its weight is the small one times
  sqrt(Dv/Dv'), since the norm runs over Dv' dims of which Dv are real.
- eps: config.json's rms_norm_eps (scaled by h/H) is exact for the hidden norms only; the per-head norms (q/k,
  the DeltaNet's gated norm: its outputs can be tiny, so eps matters there) get their own on the module.
- the MTP head (mtp.*): make_mtp_twin pads it like a full-attention layer, its fc reading the twin's embedding
  and final hidden state; it needs the twin's vocabulary to be the model's (no padded-vocabulary constant in the
  head's state), as every Qwen3.5 checkpoint's is (248320).
"""

from __future__ import annotations

import torch

from specdec.errors import ConfigError
from specdec.models.config import ModelConfig
from specdec.models.twin_builder import Builder, CastingDict, grouped_head_map, head_rows

OUTPUT_PROJECTIONS = ("self_attn.o_proj.weight", "linear_attn.out_proj.weight", "mlp.down_proj.weight")


def hybrid_problems(small: ModelConfig, big: ModelConfig, shape: dict) -> list[str]:
    """What keeps `big` (twin_config's replacement of `small` by `shape`) from being a Qwen3.5 twin of `small`."""
    problems = []
    if small.architecture != "qwen3_5":
        problems.append("a Qwen3.5 shape needs a Qwen3.5 model")
        return problems
    if "layer_types" not in shape and big.num_hidden_layers != small.num_hidden_layers:
        problems.append("a Qwen3.5 shape with more layers must give layer_types")
    elif len(big.layer_kinds) != big.num_hidden_layers:
        problems.append(f"layer_types has {len(big.layer_kinds)} entries for {big.num_hidden_layers} layers")
    else:
        try:
            layer_placement(small.layer_kinds, big.layer_kinds)
        except ConfigError as exc:
            problems.append(str(exc))
    for name in ("linear_num_key_heads", "linear_key_head_dim", "linear_value_head_dim"):
        if getattr(big, name) < getattr(small, name):
            problems.append(f"{name} {getattr(big, name)} < {getattr(small, name)}")
    if _value_group(big) < _value_group(small):
        problems.append(f"linear value heads per key head {_value_group(big)} < {_value_group(small)}")
    if big.linear_conv_kernel_dim != small.linear_conv_kernel_dim:
        problems.append(f"linear_conv_kernel_dim {big.linear_conv_kernel_dim} != {small.linear_conv_kernel_dim}")
    for name in ("rope_theta", "attn_output_gate"):  # they define the function: a shape may not change them
        if getattr(big, name) != getattr(small, name):
            problems.append(f"{name} must stay the model's ({getattr(small, name)})")
    return problems


def _value_group(config: ModelConfig) -> int:
    return config.linear_num_value_heads // config.linear_num_key_heads


def layer_placement(small_kinds: tuple[str, ...], big_kinds: tuple[str, ...]) -> list[int]:
    """The twin layer of each small layer: the next twin layer of the same type, in order.  Example: small
    [lin, lin, full], twin [lin, lin, lin, full, lin, lin, lin, full] -> [0, 1, 3] (twin layers 2, 4..7 are
    identity blocks)."""
    placement, j = [], 0
    for kind in small_kinds:
        while j < len(big_kinds) and big_kinds[j] != kind:
            j += 1
        if j == len(big_kinds):
            raise ConfigError(f"the twin's layer_types {list(big_kinds)} do not hold the model's {list(small_kinds)} "
                              "in order")
        placement.append(j)
        j += 1
    return placement


class HybridBuilder(Builder):
    """Builder plus Gated DeltaNet layers, layer placement and identity blocks of either type."""

    def __init__(self, small, small_config: ModelConfig, big_config: ModelConfig, noise: float, device, dtype):
        super().__init__(small, small_config, big_config, noise, device, dtype)
        s, b = self.sc, self.bc
        if not s.is_hybrid:
            return
        value_heads = grouped_head_map(s.linear_num_value_heads, _value_group(s), _value_group(b)).to(device)
        key_heads = torch.arange(s.linear_num_key_heads, device=device)
        self.value_heads = value_heads  # [Hv]: twin value head of each small one
        self.key_rows = head_rows(key_heads, torch.arange(s.linear_key_head_dim, device=device), b.linear_key_head_dim)
        self.value_rows = head_rows(value_heads, torch.arange(s.linear_value_head_dim, device=device),
                                b.linear_value_head_dim)  # [Hv Dv]
        # conv channels [q | k | v]: q and k blocks are Hk' Dk' wide each.  Example, Hk = 1, Dk = 2 into Hk' = 2,
        # Dk' = 2 (key width 4): q -> [0, 1], k -> 4 + [0, 1] = [4, 5], v -> 8 + value_rows
        key_width = b.linear_key_dim
        self.conv_rows = torch.cat([self.key_rows, key_width + self.key_rows, 2 * key_width + self.value_rows])

    def linear_attention(self, src: str, dst: str, out: dict) -> None:
        b, s, real = self.bc, self.sc, slice(0, self.h)
        hidden, heads = b.hidden_size, b.linear_num_value_heads
        out[dst + "in_proj_qkv.weight"] = self.linear(src + "in_proj_qkv.weight", self.conv_rows, real,
                                                      (b.linear_conv_dim, hidden))
        out[dst + "in_proj_z.weight"] = self.linear(src + "in_proj_z.weight", self.value_rows, real,
                                                    (b.linear_value_dim, hidden))
        for name in ("in_proj_b", "in_proj_a"):  # [Hv', H]: one row per value head
            out[dst + name + ".weight"] = self.linear(src + name + ".weight", self.value_heads, real, (heads, hidden))
        conv = self.fill((b.linear_conv_dim, 1, b.linear_conv_kernel_dim))
        conv[self.conv_rows] = self.small(src + "conv1d.weight")
        out[dst + "conv1d.weight"] = conv
        for name in ("dt_bias", "A_log"):
            w = self.fill(heads)
            w[self.value_heads] = self.small(src + name)
            out[dst + name] = w
        norm = self.fill(b.linear_value_head_dim)  # plain (not zero-centred) RMSNorm over each value head
        scale = (s.linear_value_head_dim / b.linear_value_head_dim) ** 0.5
        norm[:s.linear_value_head_dim] = self.small(src + "norm.weight") * scale
        out[dst + "norm.weight"] = norm
        self.writer(src + "out_proj.weight", dst + "out_proj.weight", self.value_rows, b.linear_value_dim, out)

    def layers(self, out: dict, twin: torch.nn.Module) -> None:
        placement = layer_placement(self.sc.layer_kinds, self.bc.layer_kinds)
        small_of = {j: i for i, j in enumerate(placement)}
        for j, layer in enumerate(twin.model.layers):
            dst = f"model.layers.{j}."
            if j not in small_of:
                self.identity(layer, dst, out)
                continue
            src = f"model.layers.{small_of[j]}."
            if layer.is_linear:
                self.linear_attention(src + "linear_attn.", dst + "linear_attn.", out)
            else:
                self.attention(src + "self_attn.", dst + "self_attn.", out)
            self.block(src, dst, out)
            self.exact_eps(layer)

    def exact_eps(self, layer: torch.nn.Module) -> None:
        """Per-head norms see a mean square smaller than the small model's by the fraction of real dims (and a
        DeltaNet output smaller by Dk/Dk' besides); config.json's one eps is right only for the hidden norms,
        so the twin's modules (`layer`, meta or not: eps is a plain attribute) get their own."""
        s, b, eps = self.sc, self.bc, self.sc.rms_norm_eps
        if getattr(layer, "is_linear", False):
            layer.linear_attn.norm.eps = eps * (s.linear_key_head_dim * s.linear_value_head_dim) / \
                (b.linear_key_head_dim * b.linear_value_head_dim)
        else:
            layer.self_attn.q_norm.eps = layer.self_attn.k_norm.eps = eps * s.head_dim / b.head_dim

    def identity(self, layer: torch.nn.Module, dst: str, out: dict) -> None:
        """A layer that reads anything and writes exact zeros (`layer`: the twin's, on the meta device)."""
        for name, p in layer.named_parameters():
            out[dst + name] = torch.zeros(p.shape, device=self.device) if name in OUTPUT_PROJECTIONS \
                else self.fill(p.shape)


@torch.no_grad()
def make_mtp_twin(head, twin) -> torch.nn.Module:
    """The twin of the small model's MTP head `head` (an MTPHead), for `twin` (the HybridCausalLM twin of that
    model): it drafts what `head` drafts.  The result shares the twin's embedding, LM head and rotary table.
    Where the twin pads the vocabulary, the head's logits of the padded tokens are set to -inf (its state has
    no constant dimension to push them down, as the target's has): one elementwise write beside the LM head's
    GEMM, which reads the padded head's bytes as the real model's would."""
    from specdec.models.mtp import MTPConfig, MTPHead

    small, big = head.config.layer, MTPConfig.for_target(twin.config).layer
    weight = twin.lm_head.weight
    builder = HybridBuilder(head, small, big, 0.0, weight.device, weight.dtype)
    state = CastingDict(weight.dtype)
    builder.hidden_norm("pre_fc_norm_embedding.weight", "pre_fc_norm_embedding.weight", state)
    builder.hidden_norm("pre_fc_norm_hidden.weight", "pre_fc_norm_hidden.weight", state)
    state["fc.weight"] = _mtp_fc(builder)
    builder.attention("layers.0.self_attn.", "layers.0.self_attn.", state)
    builder.block("layers.0.", "layers.0.", state)
    builder.hidden_norm("norm.weight", "norm.weight", state)
    with torch.device("meta"):
        padded = MTPHead(MTPConfig.for_target(twin.config))
    builder.exact_eps(padded.layers[0])
    padded.load_state_dict(state, assign=True)
    padded.share_target(twin)
    if twin.config.vocab_size != small.vocab_size:  # the head's state has no constant to push padded tokens down
        padded.real_vocab = small.vocab_size
    return padded.eval().requires_grad_(False)


def _mtp_fc(builder: HybridBuilder) -> torch.Tensor:
    """fc [H, 2H] reads [norm(embedding) ; norm(hidden)]: the small fc [h, 2h]'s two halves go to columns 0..h-1
    and H..H+h-1.  Row h is exactly zero: the head's stream keeps 0 at dimension h (the layer's norms ignore it
    and the vocabulary is not padded)."""
    h, big_h = builder.h, builder.bc.hidden_size
    small = builder.small("fc.weight")  # [h, 2h]
    fc = builder.fill((big_h, 2 * big_h))
    fc[:h, :h], fc[:h, big_h:big_h + h] = small[:, :h], small[:, h:]
    fc[h] = 0.0
    return fc
