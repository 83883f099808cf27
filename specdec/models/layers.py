"""Building blocks shared by the Qwen3 and Llama decoders: RMSNorm, rotary embedding, gated MLP."""

from __future__ import annotations

import math

import torch
from torch import nn

from specdec.models.config import ModelConfig
from specdec.models.fused import Kernels
from specdec.models.fused_linear import FusedProjection, fuse


class RMSNorm(nn.Module):
    """y = w * x / rms(x), computed in float32 and cast back (as transformers does)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Kernels.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, norm(x + delta))."""
        return Kernels.add_rms_norm(x, delta, self.weight, self.eps)

    def rotate_forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The rotary embedding of norm(x): x [T, heads, D], cos/sin [T, 1, D] (Qwen3's q/k norm)."""
        cos, sin = cos_sin
        return Kernels.rms_norm_rotate(x, self.weight, self.eps, cos, sin)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.gate_up: FusedProjection | None = None  # set by fuse_projections()

    def fuse_projections(self) -> bool:
        """One GEMM for gate and up (specdec.models.fused_linear; idempotent); returns whether they are fused."""
        if self.gate_up is None or not self.gate_up.valid():
            self.gate_up = fuse([self.gate_proj, self.up_proj])
        return self.gate_up is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x) if self.gate_up is not None else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(Kernels.silu_mul(gate, up))


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies, with Llama-3 scaling when configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    # Llama 3: keep high frequencies, divide low frequencies by `factor`, blend in between.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


class Rotary(nn.Module):
    """Rotary position embedding over a precomputed cos/sin table indexed by absolute position."""

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        inv_freq = rope_inverse_frequencies(config)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # [P, D/2]
        table = torch.cat([freqs, freqs], dim=-1)  # [P, D]
        self.register_buffer("cos", table.cos(), persistent=False)
        self.register_buffer("sin", table.sin(), persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D] for the positions [T] (looked up once per forward, shared by all layers)."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)

    @staticmethod
    def forward(q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]):
        """q [T, H, D], k [T, Hkv, D] -> rotated q, k."""
        cos, sin = cos_sin
        return Kernels.rotate(q, cos, sin), Kernels.rotate(k, cos, sin)
