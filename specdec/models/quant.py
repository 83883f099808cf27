"""Compact drafter weights: 4-bit group-wise (with quantization-aware training) and FP8 (e4m3) exports.

Which tensors: the projection matrices of the decoder layers (``*_proj.weight``); embeddings, the LM head
and the norms stay in bf16.

- **int4**: symmetric, per group of ``group_size`` input columns: ``scale = absmax / 7``,
  ``q = clamp(round(w / scale), -8, 7)``. Stored as ``NAME`` = uint8 ``[out, in / 2]`` (two nibbles a byte,
  ``q + 8``; even column in the low nibble) and ``NAME_scale`` = bf16 ``[out, in / group_size]``.
- **fp8**: ``NAME`` = ``float8_e4m3fn`` ``[out, in]`` of ``w / scale`` with ``NAME_scale`` = float32
  ``[out, 1]``, ``scale = absmax(row) / 448``.

``config.json`` carries ``"quantization_config": {"quant_method": "specdec", "format": "int4" | "fp8",
"group_size": G, "modules": [...]}``; ``specdec.models.loader`` dequantizes such checkpoints to the compute
dtype on the load device (so on a GPU the unpacking itself runs there).

QAT: ``enable_qat`` makes each of those weights go through ``fake_quant_int4`` in the forward (the
straight-through estimator: forward quantized, gradient as if identity); the training's export
(``specdec.train.drafter.export_quantized``) then writes exactly the weights that were trained against.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Iterable

import torch
from torch.nn.utils import parametrize

QUANT_METHOD = "specdec"
FORMATS = ("int4", "fp8")
SCALE_SUFFIX = "_scale"
FP8_MAX = 448.0
DEFAULT_GROUP_SIZE = 32


def is_quantizable(name: str, tensor: torch.Tensor) -> bool:
    """A decoder-layer projection matrix (not embeddings, the LM head or norms)."""
    return tensor.dim() == 2 and name.endswith("_proj.weight")


def _groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    out, cols = w.shape
    if cols % group_size or group_size % 2:
        raise ValueError(f"{cols} input columns are not a whole number of (even) groups of {group_size}")
    return w.float().reshape(out, cols // group_size, group_size)  # [out, G, g]


def int4_codes(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes in [-8, 7] ``[out, G, g]`` int8, scales ``[out, G]`` float32)."""
    groups = _groups(w, group_size)
    scale = (groups.abs().amax(-1) / 7.0).clamp(min=1e-8)  # [out, G]
    return torch.clamp(torch.round(groups / scale[..., None]), -8, 7).to(torch.int8), scale


def fake_quant_int4(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """``w`` rounded to its 4-bit group-wise grid in the forward, identity in the backward (STE)."""
    codes, scale = int4_codes(w.detach(), group_size)
    scale = scale.to(torch.bfloat16).float()  # the stored precision of the scales
    deq = (codes.float() * scale[..., None]).reshape(w.shape).to(w.dtype)
    return w + (deq - w).detach()


def quantize_int4(w: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 ``[out, in / 2]``, bf16 scales ``[out, in / group_size]``)."""
    codes, scale = int4_codes(w, group_size)
    nibbles = (codes.reshape(w.shape[0], -1) + 8).to(torch.uint8)  # [out, in] in [0, 15]
    return (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).contiguous(), scale.to(torch.bfloat16)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The ``[out, in]`` weight in ``dtype`` from ``quantize_int4``'s output (on their device)."""
    low = (packed & 0x0F).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    codes = torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1)  # [out, in]
    groups = codes.float().reshape(scale.shape[0], scale.shape[1], -1) * scale.float()[..., None]
    return groups.reshape(codes.shape).to(dtype)


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn ``[out, in]``, float32 per-row scales ``[out, 1]``)."""
    scale = (w.float().abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (w.float() / scale).to(torch.float8_e4m3fn), scale


def dequantize_fp8(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (data.float() * scale.float()).to(dtype)


# ---------------------------------------------------------------------------------------------- QAT


class _FakeQuant(torch.nn.Module):
    def __init__(self, group_size: int):
        super().__init__()
        self.group_size = group_size

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return fake_quant_int4(w, self.group_size)


def _quantizable_linears(model: torch.nn.Module) -> Iterable[torch.nn.Module]:
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and is_quantizable(f"{name}.weight", module.weight):
            yield module


def enable_qat(model: torch.nn.Module, group_size: int = DEFAULT_GROUP_SIZE) -> torch.nn.Module:
    """Fake-quantize every quantizable Linear weight of ``model`` (in place; the parameters stay the same
    objects, so an optimizer keeps working)."""
    for module in _quantizable_linears(model):
        if not parametrize.is_parametrized(module, "weight"):
            parametrize.register_parametrization(module, "weight", _FakeQuant(group_size))
    return model


def qat_enabled(model: torch.nn.Module) -> bool:
    return any(parametrize.is_parametrized(m) for m in model.modules())


def without_qat(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with plain (full-precision, not rounded) weights."""
    plain = copy.deepcopy(model)
    for module in list(plain.modules()):
        if parametrize.is_parametrized(module, "weight"):
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)
    return plain


# ---------------------------------------------------------------------------------------------- export / load


def quantize_state(state: dict[str, torch.Tensor], fmt: str, group_size: int = DEFAULT_GROUP_SIZE
                   ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(the tensors to save, the names quantized): quantizable weights in ``fmt``, the rest in bf16."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}: use one of {FORMATS}")
    out: dict[str, torch.Tensor] = {}
    names = []
    for name, tensor in state.items():
        tensor = tensor.detach().cpu()
        if is_quantizable(name, tensor):
            data, scale = quantize_int4(tensor, group_size) if fmt == "int4" else quantize_fp8(tensor)
            out[name], out[name + SCALE_SUFFIX] = data, scale
            names.append(name)
        else:
            out[name] = tensor.to(torch.bfloat16).contiguous()
    return out, names


def quantization_config(model_dir: Path | str) -> dict | None:
    """The ``quantization_config`` of a specdec-quantized checkpoint, else None."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    qconfig = json.loads(path.read_text()).get("quantization_config")
    if not qconfig or qconfig.get("quant_method") != QUANT_METHOD:
        return None
    return qconfig


def dequantize_state(raw: dict[str, torch.Tensor], qconfig: dict, device: torch.device,
                     dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The plain state dict (``dtype``, on ``device``) of a quantized checkpoint's tensors."""
    fmt = qconfig.get("format")
    if fmt not in FORMATS:
        raise ValueError(f"quantization format {fmt!r} is not one of {FORMATS}")
    state = {}
    for name, tensor in raw.items():
        if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in raw:
            continue
        scale = raw.get(name + SCALE_SUFFIX)
        if scale is None:
            state[name] = tensor.to(device=device, dtype=dtype)
        elif fmt == "int4":
            state[name] = dequantize_int4(tensor.to(device), scale.to(device), dtype)
        else:
            state[name] = dequantize_fp8(tensor.to(device), scale.to(device), dtype)
    return state
