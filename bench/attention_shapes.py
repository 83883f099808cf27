#!/usr/bin/env python3
"""What an attention call of a shape never seen before costs: SDPA's default kernel (cuDNN on an H100/H200)
against the engine's any-shape attention (memory-efficient kernel, query heads folded), on Qwen3-8B heads.

Steps of arbitrary shape (a prefill of a new prompt length, a drafter's catch-up, a mixed step) rarely repeat
a shape; a kernel that builds a plan per shape pays for it inside serving.  For each of several new query
lengths: the first call's time and the median of the next five, per kernel.

GPU:  python3 bench/attention_shapes.py --out $OUT/attention-shapes-h200.json
CPU dry run:  python3 bench/attention_shapes.py --device cpu --lengths 7,13 --out /tmp/attn.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.common import environment, sync, timed, write_json  # noqa: E402
from specdec.models.attention import AttentionBatch, _any_shape_attention  # noqa: E402


def inputs(length: int, heads: int, kv_heads: int, head_dim: int, device, dtype):
    """One sequence prefilling `length` tokens: q [1, H, T, D], k/v [1, Hkv, T16, D], its AttentionBatch."""
    context = -(-length // 16) * 16
    batch = AttentionBatch(torch.tensor([0, length], device=device), torch.tensor([length], device=device),
                           torch.zeros(1, 1, dtype=torch.long, device=device),
                           torch.zeros(length, dtype=torch.long, device=device), length, context).prepare(context)
    q = torch.randn(1, heads, length, head_dim, device=device, dtype=dtype)
    k = torch.randn(1, kv_heads, context, head_dim, device=device, dtype=dtype)
    return q, k, torch.randn_like(k), batch


def first_and_steady(fn, device) -> tuple[float, float]:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0, timed(fn, device, repeats=5, warmup=0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/attention-shapes-h200.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--lengths", default="37,61,83,129,211,333,517,777,1031,1500")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for length in [int(n) for n in args.lengths.split(",")]:
        q, k, v, batch = inputs(length, 32, 8, 128, device, dtype)
        default = first_and_steady(lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=batch.bias(dtype), scale=0.088, enable_gqa=True), device)
        any_shape = first_and_steady(lambda: _any_shape_attention(q, k, v, batch, 0.088), device)
        row = {"length": length, "default_first_ms": 1e3 * default[0], "default_ms": 1e3 * default[1],
               "any_shape_first_ms": 1e3 * any_shape[0], "any_shape_ms": 1e3 * any_shape[1]}
        rows.append(row)
        print(" ".join(f"{key} {value:.3f}" if isinstance(value, float) else f"{key} {value}"
                       for key, value in row.items()), flush=True)
    write_json(args.out, {"env": environment(device), "heads": "32 query / 8 KV x 128 (Qwen3-8B)", "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
