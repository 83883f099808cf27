"""Which device and dtype a model runs in, from what a user wrote ("auto", "cuda:1", "bf16", ...)."""

from __future__ import annotations

import torch

from specdec.errors import ModelLoadError


def pick_device(device: str | torch.device | None = None) -> torch.device:
    """The device named, or with None / "auto" a CUDA GPU where one is visible, else the CPU; asking for CUDA
    where none is visible is refused with what to do instead."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' was asked for but no CUDA GPU is visible; use device='cpu'")
    return device


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """A dtype from its name (float32, bf16, ...); None and "auto" leave the choice to the loader."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16, "auto": None}
    if dtype not in names:
        raise ModelLoadError(f"unknown dtype {dtype!r}: use one of {', '.join(names)}")
    return names[dtype]
