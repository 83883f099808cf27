"""ModelConfig: the architecture facts the engine needs, read from a Hugging Face config.json.

Qwen3.5 (architecture "qwen3_5") is a hybrid: `layer_types` says per layer whether it is a Gated DeltaNet
linear-attention layer (recurrent state, no KV cache) or a gated full-attention layer (paged KV).  Its
ConditionalGeneration checkpoints nest the text model's fields under "text_config"."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from specdec.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
}
NESTED_TEXT_CONFIG = {"Qwen3_5ForConditionalGeneration"}  # text model's fields under "text_config"
FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
LAYER_TYPES = (FULL_ATTENTION, LINEAR_ATTENTION)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (rope_type == "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "qwen3" | "llama" | "qwen3_5"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Hybrid (Qwen3.5) fields; the defaults describe a dense Qwen3 / Llama model.
    layer_types: tuple[str, ...] = ()  # per layer, LAYER_TYPES; empty: every layer is full attention
    linear_conv_kernel_dim: int = 0  # Gated DeltaNet: causal depthwise conv width over q/k/v
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0  # a multiple of linear_num_key_heads (grouped value heads)
    partial_rotary_factor: float = 1.0  # the first head_dim * factor dims of q/k are rotated
    attn_output_gate: bool = False  # attention output * sigmoid(gate), the gate read by q_proj beside q
    zero_centred_norm: bool = False  # RMSNorm y = x / rms(x) * (1 + w) in float32, then cast
    mrope_section: tuple[int, ...] = ()  # M-RoPE axes (t, h, w); text-only positions make it plain RoPE
    mrope_interleaved: bool = False

    @property
    def num_query_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """The type of every layer (layer_types, or all full attention for a dense model)."""
        return self.layer_types or (FULL_ATTENTION,) * self.num_hidden_layers

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        """Indices of the full-attention layers: the layers that own a KV cache, in order."""
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind == FULL_ATTENTION)

    @property
    def linear_layer_ids(self) -> tuple[int, ...]:
        """Indices of the linear-attention layers: the layers that own a recurrent state, in order."""
        return tuple(i for i, kind in enumerate(self.layer_kinds) if kind == LINEAR_ATTENTION)

    @property
    def num_attention_layers(self) -> int:
        return len(self.attention_layer_ids)

    @property
    def is_hybrid(self) -> bool:
        return bool(self.linear_layer_ids)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the causal conv (and of its state): q, k and v side by side."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        architectures = raw.get("architectures") or []
        known = [a for a in architectures if a in SUPPORTED_ARCHITECTURES]
        if not known and any("eagle" in str(a).lower() for a in architectures):
            raise ModelLoadError(
                f"this is an EAGLE-3 draft head ({', '.join(architectures)}), not a model to serve or draft with: "
                f"give it beside its target with --speculator eagle3 --draft-model DIR "
                f"(SpecConfig('eagle3', model=DIR))")
        if not known:
            raise ModelLoadError(
                f"unsupported architecture {architectures or raw.get('model_type')!r}: specdec runs "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}; check 'architectures' in config.json"
            )
        arch = SUPPORTED_ARCHITECTURES[known[0]]
        if known[0] in NESTED_TEXT_CONFIG:
            raw = _text_config(raw)
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            kv_heads = int(raw.get("num_key_value_heads") or heads)
            head_dim = int(raw.get("head_dim") or hidden // heads)
            config = cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                head_dim=head_dim,
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(_rope_theta(raw)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", False)),
                qk_norm=arch in ("qwen3", "qwen3_5"),
                rope_scaling=_rope_scaling(raw),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=_as_id_tuple(raw.get("eos_token_id")),
                **(_hybrid_fields(raw) if arch == "qwen3_5" else {}),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"config.json is missing or has a bad value for {exc}") from exc
        if heads % kv_heads:
            raise ModelLoadError(
                f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
            )
        if arch == "qwen3_5":
            _check_hybrid(config)
        return config

    @classmethod
    def from_dir(cls, model_dir: Path) -> "ModelConfig":
        return cls.from_dict(read_config_json(Path(model_dir)))


def read_config_json(model_dir: Path, what: str = "a Hugging Face model directory") -> dict:
    """model_dir/config.json as a dict; refused, naming the file, where it is missing or not JSON."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{model_dir} has no config.json: pass {what}")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """transformers >= 5 writes `rope_parameters`; older configs write `rope_scaling` + `rope_theta`."""
    params = dict(raw.get("rope_scaling") or {})
    params.update(raw.get("rope_parameters") or {})
    return params


def _rope_theta(raw: dict[str, Any]) -> float:
    return _rope_parameters(raw).get("rope_theta", raw.get("rope_theta", 10000.0))


def _rope_scaling(raw: dict[str, Any]) -> RopeScaling | None:
    params = _rope_parameters(raw)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return None
    if rope_type != "llama3":
        raise ModelLoadError(
            f"unsupported rope scaling {rope_type!r}: specdec supports the default RoPE and 'llama3' scaling"
        )
    return RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def _text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The text model's fields of a ConditionalGeneration config: text_config, with vocab / bos / eos taken
    from the top level where text_config lacks them, and the top level's tie_word_embeddings (transformers
    ties by the outer config)."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ModelLoadError(f"config.json of {raw.get('architectures')} has no text_config: specdec reads the "
                             "text model's fields from it")
    body = dict(text)
    for key in ("vocab_size", "bos_token_id", "eos_token_id"):
        if body.get(key) is None and raw.get(key) is not None:
            body[key] = raw[key]
    if "tie_word_embeddings" in raw:
        body["tie_word_embeddings"] = raw["tie_word_embeddings"]
    return body


def _hybrid_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5's fields, with transformers' defaults where config.json leaves them out."""
    num_layers = int(raw["num_hidden_layers"])
    rope = _rope_parameters(raw)
    return dict(
        layer_types=_layer_types(raw, num_layers),
        linear_conv_kernel_dim=int(raw.get("linear_conv_kernel_dim", 4)),
        linear_key_head_dim=int(raw.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(raw.get("linear_value_head_dim", 128)),
        linear_num_key_heads=int(raw.get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(raw.get("linear_num_value_heads", 32)),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25))),
        attn_output_gate=bool(raw.get("attn_output_gate", True)),
        zero_centred_norm=True,
        mrope_section=tuple(int(n) for n in rope.get("mrope_section") or ()),
        mrope_interleaved=bool(rope.get("mrope_interleaved", False)),
    )


def _layer_types(raw: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """layer_types as given, else derived as transformers does: every full_attention_interval-th layer
    (default 4) is full attention.  Example: 8 layers, interval 4 -> linear x3, full, linear x3, full."""
    types = raw.get("layer_types")
    allowed = " or ".join(repr(t) for t in LAYER_TYPES)
    if types is None:
        interval = int(raw.get("full_attention_interval", 4))
        if interval < 1:
            raise ModelLoadError(f"full_attention_interval must be >= 1 (got {interval}); or give layer_types")
        return tuple(LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(num_layers))
    if not isinstance(types, (list, tuple)):
        raise ModelLoadError(f"layer_types must be a list of {allowed}, one per layer (got {types!r})")
    bad = sorted({str(t) for t in types if t not in LAYER_TYPES})
    if bad:
        raise ModelLoadError(f"layer_types has unsupported entries {bad}: each must be {allowed}")
    if len(types) != num_layers:
        raise ModelLoadError(f"layer_types has {len(types)} entries but num_hidden_layers is {num_layers}: "
                             "give one entry per layer")
    return tuple(types)


def _check_hybrid(config: ModelConfig) -> None:
    if config.linear_num_value_heads % config.linear_num_key_heads:
        raise ModelLoadError(f"linear_num_value_heads ({config.linear_num_value_heads}) must be a multiple of "
                             f"linear_num_key_heads ({config.linear_num_key_heads})")
    if config.linear_conv_kernel_dim < 1:
        raise ModelLoadError(f"linear_conv_kernel_dim must be >= 1 (got {config.linear_conv_kernel_dim})")
    rotary = config.rotary_dim
    if rotary < 2 or rotary % 2 or rotary > config.head_dim:
        raise ModelLoadError(f"partial_rotary_factor {config.partial_rotary_factor} gives {rotary} rotary dims "
                             f"of head_dim {config.head_dim}: they must be even, >= 2 and <= head_dim")
