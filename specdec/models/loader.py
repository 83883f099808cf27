"""Load a Hugging Face model directory (config.json + safetensors) into a CausalLM.  No pickle."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from specdec.errors import ModelLoadError
from specdec.models.config import ModelConfig
from specdec.models.layers import Rotary
from specdec.models.transformer import CausalLM

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def default_dtype(device: torch.device) -> torch.dtype:
    """float32 on CPU, bfloat16 on accelerators."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files holding the weights, from the shard index when there is one."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index} is corrupt ({exc}): re-download or re-save the checkpoint") from exc
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{model_dir} lacks shard(s) {missing} named in {INDEX_FILE}")
        return files
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
        raise ModelLoadError(
            f"{model_dir} holds only pickle weights (.bin/.pt); specdec loads safetensors only: re-save with "
            "model.save_pretrained(dir, safe_serialization=True)"
        )
    raise ModelLoadError(f"{model_dir} has no {SINGLE_FILE} or {INDEX_FILE}")


def read_state_dict(model_dir: Path, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from specdec.models.quant import dequantize_state, quantization_config

    qconfig = quantization_config(model_dir)  # 4-bit / FP8 exports: read as stored, dequantized below
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    tensor = f.get_tensor(name)
                    state[name] = tensor if qconfig else tensor.to(device=device, dtype=dtype)
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise ModelLoadError(f"cannot read {path}: {exc}; the file is corrupt or truncated") from exc
    if qconfig:
        try:
            state = dequantize_state(state, qconfig, device, dtype)
        except (ValueError, RuntimeError) as exc:
            raise ModelLoadError(f"{model_dir}: cannot dequantize ({exc})") from exc
    return state


def load_model(model_dir: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = None) -> CausalLM:
    """A CausalLM in eval mode on `device`, weights in `dtype` (default: float32 CPU, bfloat16 GPU)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir} does not exist")
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    config = ModelConfig.from_dir(model_dir)
    state = read_state_dict(model_dir, device, dtype)
    with torch.device("meta"):
        model = CausalLM(config)
    _check_keys(model, state, config, model_dir)
    _check_shapes(model, state, model_dir)
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    _attach_rotary(model, config, device)
    return model.eval().requires_grad_(False)


def _check_keys(model: CausalLM, state: dict, config: ModelConfig, model_dir: Path) -> None:
    expected = set(model.state_dict().keys())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
        state.pop("lm_head.weight", None)
    missing = sorted(expected - state.keys())
    unexpected = sorted(k for k in state.keys() - expected if not k.endswith("rotary_emb.inv_freq"))
    if missing:
        raise ModelLoadError(f"{model_dir} lacks weights {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if unexpected:
        raise ModelLoadError(
            f"{model_dir} has weights this architecture does not use: {unexpected[:5]}: is config.json right?")


def _check_shapes(model: CausalLM, state: dict, model_dir: Path) -> None:
    for name, tensor in model.state_dict().items():
        if name in state and tuple(state[name].shape) != tuple(tensor.shape):
            raise ModelLoadError(f"{model_dir}: weight {name} has shape {tuple(state[name].shape)}, "
                                 f"config.json implies {tuple(tensor.shape)}")


@torch.no_grad()
def random_model(config: ModelConfig, device: str | torch.device, dtype: torch.dtype, seed: int = 0,
                 std: float = 0.02) -> CausalLM:
    """A CausalLM with random weights made directly on `device` (benchmarks at real model shapes)."""
    device = torch.device(device)
    with torch.device("meta"):
        model = CausalLM(config)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, std, generator=gen)
    model.to(dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    _attach_rotary(model, config, device)
    return model.eval().requires_grad_(False)


def _attach_rotary(model: CausalLM, config: ModelConfig, device: torch.device) -> None:
    model.rotary = Rotary(config, config.max_position_embeddings).to(device)
