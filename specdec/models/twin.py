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
from specdec.models.twin_builder import Builder, CastingDict
from specdec.models.twin_qwen3_5 import HybridBuilder, hybrid_problems

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
        problems += hybrid_problems(small, big, shape)
    if problems:
        raise ConfigError("cannot build this twin: " + "; ".join(problems))
    return big


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
    state = CastingDict(dtype)  # each weight is cast as it is made: peak memory ~ the twin + one fp32 matrix
    builder.vocab(state, c, u)
    builder.layers(state, twin)
    twin.load_state_dict(state, strict=False, assign=True)
    if big_config.tie_word_embeddings:
        twin.lm_head.weight = twin.model.embed_tokens.weight
    _attach_rotary(twin, big_config, device)
    return twin.eval().requires_grad_(False)


def _builder_class(config: ModelConfig) -> type[Builder]:
    return HybridBuilder if config.architecture == "qwen3_5" else Builder


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
