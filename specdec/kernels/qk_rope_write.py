"""The attention's inputs of a decode or verify step in one Triton launch per layer: the per-head RMSNorm of
queries and keys (Qwen3's, or Qwen3.5's zero-centred one), the rotary embedding of both (of each head's first
R dims: all of them, or Qwen3.5's partial rotary), and the write of the new keys and values into the paged cache.

Without it a layer runs four kernels or more for this (the query's norm and rotation, the key's, and one cache
write each for keys and values), each a few microseconds of mostly launch latency at batch 1: 144 of the 8B
shape's 555 kernels a step.  Inputs are the projections' views (q [T, H, D], k and v [T, Hkv, D], rows strided as
they come out of one fused QKV GEMM, a Qwen3.5 query beside its gate), the step's cos/sin [T, 1, R] and
slot_mapping [T]; the output is the rotated queries [T, H, D], contiguous.  Keys and values go only to the cache,
where attention reads them.  Eager steps and CUDA-graph captures call it; a step compiled whole by torch.compile
keeps the plain pieces, which inductor fuses itself.

One program handles one (token, head): heads 0 .. H - 1 are query heads, H .. H + Hkv - 1 key heads, which also
copy the value head of the same index.  The arithmetic follows models/fused.py's pieces: rms_norm rounds the
normalised row to the input dtype, multiplies by the weight and rounds again; zero_centred_rms_norm scales by
1 + weight in float32 and rounds once; the rotation runs in float32 and rounds once.  Rotate-half layout over the
first R dims: out[i] = n[i] cos[i] - n[i + R/2] sin[i] for i < R/2, n[i] cos[i] + n[i - R/2] sin[i] for
R/2 <= i < R, n[i] beyond R.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _normed(ptr, weight_ptr, dims, ok, inv, CENTRED: tl.constexpr, HAS_NORM: tl.constexpr):
    """Row values at dims [D_PAD], RMS-normed by inv (HAS_NORM) and rounded as the plain pieces round, in float32:
    rms_norm rounds the normed row, then its product with the weight; the zero-centred norm (CENTRED) scales by
    1 + weight in float32 and rounds once."""
    x = tl.load(ptr + dims, mask=ok, other=0.0)
    if not HAS_NORM:
        return x.to(tl.float32)
    w = tl.load(weight_ptr + dims, mask=ok, other=0.0).to(tl.float32)
    if CENTRED:
        return (x.to(tl.float32) * inv * (1.0 + w)).to(x.dtype).to(tl.float32)
    return (w * (x.to(tl.float32) * inv).to(x.dtype).to(tl.float32)).to(x.dtype).to(tl.float32)


@triton.jit
def _rotated_row(ptr, weight_ptr, cos_row, sin_row, out_ptr, eps, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                 ROT: tl.constexpr, CENTRED: tl.constexpr, HAS_NORM: tl.constexpr):
    """One head's row normed, its first ROT dims rotated (rotate-half pairs i, i + ROT / 2), stored at out_ptr."""
    dims = tl.arange(0, D_PAD)
    ok = dims < HEAD_DIM
    inv = 1.0
    if HAS_NORM:
        x = tl.load(ptr + dims, mask=ok, other=0.0).to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, 0) / HEAD_DIM + eps)
    n = _normed(ptr, weight_ptr, dims, ok, inv, CENTRED, HAS_NORM)
    # The rotation partner of dim i < ROT: i + ROT / 2 in the first half (entering with a minus), i - ROT / 2 in
    # the second.  Example, ROT 4: dims 0 1 2 3 -> partners 2 3 0 1, signs - - + +; dims >= ROT pass through.
    rotated = dims < ROT
    partner = tl.where(dims < ROT // 2, dims + ROT // 2, dims - ROT // 2)
    n_partner = _normed(ptr, weight_ptr, partner, rotated & ok, inv, CENTRED, HAS_NORM)
    sign = tl.where(dims < ROT // 2, -1.0, 1.0)
    cos = tl.load(cos_row + dims, mask=rotated, other=1.0).to(tl.float32)
    sin = tl.load(sin_row + dims, mask=rotated, other=0.0).to(tl.float32)
    out = tl.where(rotated, n * cos + sign * n_partner * sin, n)
    tl.store(out_ptr + dims, out, mask=ok)


@triton.jit
def _qk_rope_write_kernel(q_ptr, k_ptr, v_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, slots_ptr, q_out_ptr,
                          k_cache_ptr, v_cache_ptr, eps, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
                          stride_vh, stride_ct, stride_st, stride_ot, stride_oh, stride_kcs, stride_kch, stride_vcs,
                          stride_vch, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                          ROT: tl.constexpr, CENTRED: tl.constexpr, HAS_NORM: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    cos_row = cos_ptr + token * stride_ct
    sin_row = sin_ptr + token * stride_st
    if head < HEADS:
        _rotated_row(q_ptr + token * stride_qt + head * stride_qh, q_weight_ptr, cos_row, sin_row,
                     q_out_ptr + token * stride_ot + head * stride_oh, eps, HEAD_DIM, D_PAD, ROT, CENTRED, HAS_NORM)
    else:
        kv_head = head - HEADS
        slot = tl.load(slots_ptr + token).to(tl.int64)
        _rotated_row(k_ptr + token * stride_kt + kv_head * stride_kh, k_weight_ptr, cos_row, sin_row,
                     k_cache_ptr + slot * stride_kcs + kv_head * stride_kch, eps, HEAD_DIM, D_PAD, ROT, CENTRED,
                     HAS_NORM)
        dims = tl.arange(0, D_PAD)
        ok = dims < HEAD_DIM
        v_row = tl.load(v_ptr + token * stride_vt + kv_head * stride_vh + dims, mask=ok, other=0.0)
        tl.store(v_cache_ptr + slot * stride_vcs + kv_head * stride_vch + dims, v_row, mask=ok)


def supports(dtype: torch.dtype, k_cache: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether `qk_rope_write` handles a layer whose projections come out in dtype: float inputs and a cache of
    that dtype, a rotation over an even number of the head's first dims, unit strides along each cache head's
    dims."""
    head_dim, rot = k_cache.shape[-1], cos.shape[-1]
    return (dtype in DTYPES and k_cache.dtype == dtype and head_dim <= 512 and rot % 2 == 0
            and 2 <= rot <= head_dim and k_cache.stride(-1) == 1)


def qk_rope_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor | None,
                  k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                  slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  centred: bool = False) -> torch.Tensor:
    """q [T, H, D], k, v [T, Hkv, D]; weights [D] (both None: no norm, Llama); cos, sin [T, 1, R] rotating each
    head's first R dims (R = D but for Qwen3.5's partial rotary); slot_mapping [T]; k_cache, v_cache [slots, Hkv,
    D]; centred: the norms scale by 1 + weight (Qwen3.5) -> rotated queries [T, H, D] (keys and values written)."""
    tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    q_out = torch.empty((tokens, heads, head_dim), dtype=q.dtype, device=q.device)
    if tokens == 0:
        return q_out
    has_norm = q_weight is not None
    _qk_rope_write_kernel[(tokens, heads + kv_heads)](
        q, k, v, q_weight if has_norm else q, k_weight if has_norm else k, cos, sin, slot_mapping, q_out, k_cache,
        v_cache, float(eps), q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0), q_out.stride(0), q_out.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), HEADS=heads, HEAD_DIM=head_dim,
        D_PAD=triton.next_power_of_2(head_dim), ROT=cos.shape[-1], CENTRED=centred, HAS_NORM=has_norm)
    return q_out
