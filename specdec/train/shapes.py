"""The models the training pipeline builds, less their vocabulary (taken from the tokenizer): a Qwen3
(``ModelShape``: ref-target's and ref-draft's) or a Qwen3.5-shaped hybrid (``HybridShape``), and the
transformers config of each.

Qwen3.5 interleaves Gated DeltaNet layers (``linear_attention``: a recurrent state per head, no KV cache) with
gated full-attention layers, one full-attention layer every ``full_attention_interval`` layers (4 in every
published Qwen3.5), partial rotary embeddings (a quarter of each head's dimensions) and M-RoPE sections that
text-only positions reduce to plain RoPE. The model is ``transformers.Qwen3_5ForCausalLM`` (``model_type``
``qwen3_5_text``): the text-only layout specdec's loader reads.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class ModelShape:
    """Architecture of a Qwen3 model, less the vocabulary (taken from the tokenizer)."""

    hidden_size: int = 384
    num_layers: int = 8
    num_heads: int = 6
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 960
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True


TARGET_SHAPE = ModelShape()
ARCHS = ("qwen3", "qwen3_5")
DRAFT_SHAPE = ModelShape(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=768)


def config_kwargs(shape: ModelShape, vocab_size: int, eos_token_id: int, pad_token_id: int | None = None) -> dict:
    """The transformers config fields every architecture takes from a ``ModelShape`` (no BOS; pad = EOS unless
    given). ``rope_parameters`` holds default RoPE at ``rope_theta``; an architecture may add to it."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(shape.rope_theta)},
        tie_word_embeddings=shape.tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id if pad_token_id is None else pad_token_id,
    )


def qwen3_config(shape: ModelShape, vocab_size: int, eos_token_id: int, pad_token_id: int | None = None):
    """A ``transformers.Qwen3Config`` for ``shape`` (default RoPE, no sliding window, no bias)."""
    from transformers import Qwen3Config

    return Qwen3Config(**config_kwargs(shape, vocab_size, eos_token_id, pad_token_id), use_sliding_window=False,
                       architectures=["Qwen3ForCausalLM"])


@dataclasses.dataclass
class HybridShape(ModelShape):
    """A Qwen3.5 hybrid: ``ModelShape`` plus the layer pattern and the Gated DeltaNet dimensions.

    The defaults size it like ref-target (hidden 384, 8 layers, 6 heads / 2 KV heads of 64, intermediate 960,
    tied embeddings; ~16M parameters with the 8192-token vocabulary) so the two compare at equal cost:
    8 layers at Qwen3.5's interval of 4 give 6 DeltaNet and 2 full-attention layers (layers 4 and 8).
    DeltaNet heads keep Qwen3.5-27B's proportions at this width: 3 value heads per key head (27B: 16 key /
    48 value heads of 128), here 2 key / 6 value heads of 64, so the value width equals the hidden size;
    a DeltaNet layer then costs about as much as a full-attention one. Conv kernel 4 and partial rotary
    factor 0.25 (16 rotary dims of 64) are Qwen3.5's own. rope_theta stays at ref-target's 10000: the model
    is trained on 512-token windows, not Qwen3.5's long contexts.
    """

    full_attention_interval: int = 4
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 6
    linear_key_head_dim: int = 64
    linear_value_head_dim: int = 64
    linear_conv_kernel_dim: int = 4
    partial_rotary_factor: float = 0.25


HYBRID_TARGET_SHAPE = HybridShape()
LINEAR_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_conv_kernel_dim")  # HybridShape fields that Qwen3_5TextConfig takes under the same name


def layer_types(shape: HybridShape) -> list[str]:
    """Per layer ``linear_attention`` or ``full_attention``: every ``full_attention_interval``-th is full."""
    every = shape.full_attention_interval
    return ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(shape.num_layers)]


def mrope_section(rotary_dim: int) -> list[int]:
    """M-RoPE (t, h, w) sections of ``rotary_dim // 2`` frequencies, split as Qwen3.5's [11, 11, 10] of 32."""
    half = rotary_dim // 2
    return [half // 3 + (i < half % 3) for i in range(3)]


def qwen3_5_config(shape: HybridShape, vocab_size: int, eos_token_id: int, pad_token_id: int | None = None):
    """A ``transformers.Qwen3_5TextConfig`` for ``shape`` (text only, no bias, no MTP layers)."""
    from transformers import Qwen3_5TextConfig

    rotary_dim = int(shape.head_dim * shape.partial_rotary_factor)
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"head_dim {shape.head_dim} x partial_rotary_factor {shape.partial_rotary_factor} "
                         f"gives {rotary_dim} rotary dims: need an even number >= 2")
    if shape.linear_num_value_heads % shape.linear_num_key_heads:
        raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    kwargs = config_kwargs(shape, vocab_size, eos_token_id, pad_token_id)
    kwargs["rope_parameters"].update(partial_rotary_factor=shape.partial_rotary_factor,
                                     mrope_section=mrope_section(rotary_dim), mrope_interleaved=True)
    linear = {name: getattr(shape, name) for name in LINEAR_FIELDS}
    return Qwen3_5TextConfig(**kwargs, **linear, layer_types=layer_types(shape), architectures=["Qwen3_5ForCausalLM"])


def target_shape(arch: str) -> ModelShape:
    """The default target shape of ``arch`` (``qwen3``: ref-target's; ``qwen3_5``: the hybrid's)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}: choose one of {', '.join(ARCHS)}")
    if arch == "qwen3_5":
        return HYBRID_TARGET_SHAPE
    return TARGET_SHAPE


def model_config(shape: ModelShape, vocab_size: int, eos_token_id: int, pad_token_id: int | None = None):
    """The transformers config of ``shape``: Qwen3.5 text for a ``HybridShape``, Qwen3 otherwise."""
    build = qwen3_5_config if isinstance(shape, HybridShape) else qwen3_config
    return build(shape, vocab_size, eos_token_id, pad_token_id)
