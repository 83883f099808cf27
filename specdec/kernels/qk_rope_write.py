"""The attention's inputs of a decode or verify step in one Triton launch per layer: Qwen3's per-head RMSNorm of
queries and keys, the rotary embedding of both, and the write of the new keys and values into the paged cache.

Without it a layer runs four kernels for this (the query's norm and rotation, the key's, and one cache write
each for keys and values), each a few microseconds of mostly launch latency at batch 1: 144 of the 8B shape's
555 kernels a step.  Inputs are the projections' views (q [T, H, D], k and v [T, Hkv, D], rows strided as they
come out of one fused QKV GEMM), the step's cos/sin [T, 1, D] and slot_mapping [T]; the output is the rotated
queries [T, H, D], contiguous.  Keys and values go only to the cache, where attention reads them.  Eager
steps and CUDA-graph captures call it; a step compiled whole by torch.compile keeps the plain pieces, which
inductor fuses itself.

One program handles one (token, head): heads 0 .. H - 1 are query heads, H .. H + Hkv - 1 key heads, which also
copy the value head of the same index.  The arithmetic follows models/fused.py's rms_norm_rotate (the
normalised row rounded to the input dtype, times the weight, rounded again; the rotation in float32, rounded
once).  Rotate-half layout, for head_dim D = 2h: out[:h] = n[:h] * cos[:h] - n[h:] * sin[:h] and
out[h:] = n[h:] * cos[h:] + n[:h] * sin[h:].
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _normed_halves(ptr, weight_ptr, dims, ok, eps, HALF: tl.constexpr, HAS_NORM: tl.constexpr):
    """A head's two halves [HALF_PAD] each, RMS-normed (HAS_NORM) and rounded as rms_norm does, in float32."""
    lo = tl.load(ptr + dims, mask=ok, other=0.0)
    hi = tl.load(ptr + HALF + dims, mask=ok, other=0.0)
    if HAS_NORM:
        lo32, hi32 = lo.to(tl.float32), hi.to(tl.float32)
        mean = (tl.sum(lo32 * lo32, 0) + tl.sum(hi32 * hi32, 0)) / (2 * HALF)
        inv = tl.rsqrt(mean + eps)
        w_lo = tl.load(weight_ptr + dims, mask=ok, other=0.0)
        w_hi = tl.load(weight_ptr + HALF + dims, mask=ok, other=0.0)
        # each product in float32, rounded to the input dtype as PyTorch rounds a bf16/fp16 product
        lo = (w_lo.to(tl.float32) * (lo32 * inv).to(lo.dtype).to(tl.float32)).to(lo.dtype)
        hi = (w_hi.to(tl.float32) * (hi32 * inv).to(hi.dtype).to(tl.float32)).to(hi.dtype)
    return lo.to(tl.float32), hi.to(tl.float32)


@triton.jit
def _qk_rope_write_kernel(q_ptr, k_ptr, v_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, slots_ptr, q_out_ptr,
                          k_cache_ptr, v_cache_ptr, eps, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                          stride_vh, stride_ct, stride_st, stride_ot, stride_oh, stride_kcs, stride_kch, stride_vcs,
                          stride_vch, HEADS: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                          HAS_NORM: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    dims = tl.arange(0, HALF_PAD)
    ok = dims < HALF
    cos_row = cos_ptr + token * stride_ct
    sin_row = sin_ptr + token * stride_st
    cos_lo = tl.load(cos_row + dims, mask=ok, other=0.0).to(tl.float32)
    cos_hi = tl.load(cos_row + HALF + dims, mask=ok, other=0.0).to(tl.float32)
    sin_lo = tl.load(sin_row + dims, mask=ok, other=0.0).to(tl.float32)
    sin_hi = tl.load(sin_row + HALF + dims, mask=ok, other=0.0).to(tl.float32)
    if head < HEADS:
        lo, hi = _normed_halves(q_ptr + token * stride_qt + head * stride_qh, q_weight_ptr, dims, ok, eps, HALF,
                                HAS_NORM)
        out = q_out_ptr + token * stride_ot + head * stride_oh
        tl.store(out + dims, lo * cos_lo - hi * sin_lo, mask=ok)
        tl.store(out + HALF + dims, hi * cos_hi + lo * sin_hi, mask=ok)
    else:
        kv_head = head - HEADS
        slot = tl.load(slots_ptr + token).to(tl.int64)
        lo, hi = _normed_halves(k_ptr + token * stride_kt + kv_head * stride_kh, k_weight_ptr, dims, ok, eps, HALF,
                                HAS_NORM)
        out = k_cache_ptr + slot * stride_kcs + kv_head * stride_kch
        tl.store(out + dims, lo * cos_lo - hi * sin_lo, mask=ok)
        tl.store(out + HALF + dims, hi * cos_hi + lo * sin_hi, mask=ok)
        v_row = v_ptr + token * stride_vt + kv_head * stride_vh
        v_out = v_cache_ptr + slot * stride_vcs + kv_head * stride_vch
        tl.store(v_out + dims, tl.load(v_row + dims, mask=ok, other=0.0), mask=ok)
        tl.store(v_out + HALF + dims, tl.load(v_row + HALF + dims, mask=ok, other=0.0), mask=ok)


def supports(dtype: torch.dtype, k_cache: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether `qk_rope_write` handles a layer whose projections come out in dtype: float inputs and a cache of
    that dtype, an even head_dim (the cache's last dim) that the rotation covers whole, unit strides along each
    cache head's dims."""
    head_dim = k_cache.shape[-1]
    return (dtype in DTYPES and k_cache.dtype == dtype and head_dim % 2 == 0 and head_dim <= 512
            and cos.shape[-1] == head_dim and k_cache.stride(-1) == 1)


def qk_rope_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor | None,
                  k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                  slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """q [T, H, D], k, v [T, Hkv, D]; weights [D] (both None: no norm, Llama); cos, sin [T, 1, D];
    slot_mapping [T]; k_cache, v_cache [slots, Hkv, D] -> rotated queries [T, H, D] (keys and values written)."""
    tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    q_out = torch.empty((tokens, heads, head_dim), dtype=q.dtype, device=q.device)
    if tokens == 0:
        return q_out
    has_norm = q_weight is not None
    half = head_dim // 2
    _qk_rope_write_kernel[(tokens, heads + kv_heads)](
        q, k, v, q_weight if has_norm else q, k_weight if has_norm else k, cos, sin, slot_mapping, q_out, k_cache,
        v_cache, float(eps), q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0), q_out.stride(0), q_out.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), HEADS=heads, HALF=half, HALF_PAD=triton.next_power_of_2(half),
        HAS_NORM=has_norm)
    return q_out
