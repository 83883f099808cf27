"""Load a Hugging Face model directory (config.json + safetensors) into a CausalLM (Qwen3, Llama) or a
HybridCausalLM (Qwen3.5).  No pickle.

Qwen3.5 checkpoints of the multimodal layout (Qwen3_5ForConditionalGeneration) hold the text model under
model.language_model.*, which loads as model.*; the vision tower (model.visual.*) is skipped, and the
multi-token-prediction head (mtp.*) is set aside for `read_mtp_state`."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open

from specdec.errors import ModelLoadError
from specdec.models.config import ModelConfig
from specdec.models.layers import Rotary
from specdec.models.qwen3_5 import HybridCausalLM, PartialRotary, init_random_
from specdec.models.transformer import CausalLM

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TEXT_PREFIX = "model.language_model."  # a ConditionalGeneration checkpoint's text model ...
VISION_PREFIX = "model.visual."  # ... its vision tower ...
MTP_PREFIX = "mtp."  # ... and any Qwen3.5 checkpoint's multi-token-prediction head
log = logging.getLogger("specdec")

Model = CausalLM | HybridCausalLM


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


def read_state_dict(model_dir: Path, device: torch.device, dtype: torch.dtype,
                    rename: Callable[[str], str | None] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, by name; rename(name) gives the name to keep it under, None to skip it
    unread (default: all, as stored)."""
    from specdec.models.quant import dequantize_state, quantization_config

    qconfig = quantization_config(model_dir)  # 4-bit / FP8 exports: read as stored, dequantized below
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    key = rename(name) if rename is not None else name
                    if key is None:
                        continue
                    tensor = f.get_tensor(name)
                    state[key] = tensor if qconfig else tensor.to(device=device, dtype=dtype)
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise ModelLoadError(f"cannot read {path}: {exc}; the file is corrupt or truncated") from exc
    if qconfig:
        try:
            state = dequantize_state(state, qconfig, device, dtype)
        except (ValueError, RuntimeError) as exc:
            raise ModelLoadError(f"{model_dir}: cannot dequantize ({exc})") from exc
    return state


def read_mtp_state(model_dir: str | Path, device: str | torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The checkpoint's multi-token-prediction weights (mtp.*, names as stored) on `device` in `dtype`; {} when
    it has none.  load_model leaves them out."""
    return read_state_dict(Path(model_dir), torch.device(device), dtype,
                           rename=lambda name: name if name.startswith(MTP_PREFIX) else None)


class _TextModelNames:
    """Checkpoint name -> module name of a hybrid model (None: skip), noting what it skipped."""

    def __init__(self):
        self.skipped_vision = False

    def __call__(self, name: str) -> str | None:
        if name.startswith(TEXT_PREFIX):
            return "model." + name[len(TEXT_PREFIX):]
        if name.startswith(VISION_PREFIX):
            self.skipped_vision = True
            return None
        if name.startswith(MTP_PREFIX):
            return None
        return name


def model_class(config: ModelConfig) -> type[Model]:
    return HybridCausalLM if config.architecture == "qwen3_5" else CausalLM


def load_model(model_dir: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = None) -> Model:
    """A CausalLM (HybridCausalLM for Qwen3.5) in eval mode on `device`, weights in `dtype` (default: float32
    CPU, bfloat16 GPU)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir} does not exist")
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    config = ModelConfig.from_dir(model_dir)
    names = _TextModelNames() if config.architecture == "qwen3_5" else None
    state = read_state_dict(model_dir, device, dtype, rename=names)
    if names is not None and names.skipped_vision:
        log.info("vision tower skipped: specdec runs the text model")
    with torch.device("meta"):
        model = model_class(config)(config)
    _check_keys(model, state, config, model_dir)
    _check_shapes(model, state, model_dir)
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    _attach_rotary(model, config, device)
    return model.eval().requires_grad_(False)


def _check_keys(model: Model, state: dict, config: ModelConfig, model_dir: Path) -> None:
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


def _check_shapes(model: Model, state: dict, model_dir: Path) -> None:
    for name, tensor in model.state_dict().items():
        if name in state and tuple(state[name].shape) != tuple(tensor.shape):
            raise ModelLoadError(f"{model_dir}: weight {name} has shape {tuple(state[name].shape)}, "
                                 f"config.json implies {tuple(tensor.shape)}")


@torch.no_grad()
def random_model(config: ModelConfig, device: str | torch.device, dtype: torch.dtype, seed: int = 0,
                 std: float = 0.02) -> Model:
    """A CausalLM (HybridCausalLM for Qwen3.5) with random weights made directly on `device` (benchmarks at
    real model shapes)."""
    device = torch.device(device)
    with torch.device("meta"):
        model = model_class(config)(config)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    if isinstance(model, HybridCausalLM):
        init_random_(model, gen, std)
    else:
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


def _attach_rotary(model: Model, config: ModelConfig, device: torch.device) -> None:
    rotary = PartialRotary if isinstance(model, HybridCausalLM) else Rotary
    model.rotary = rotary(config, config.max_position_embeddings).to(device)
