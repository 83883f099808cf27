#!/usr/bin/env python3
"""The Triton paged-attention kernel (specdec/kernels/paged_attention.py) against the engine's gather + SDPA
path (specdec/models/attention.py), one attention layer at the Qwen3-8B shape (32 query heads, 8 KV heads of
128, bf16, block size 16), for batch x context x queries per sequence.

Per shape and path: the per-step preparation (AttentionBatch.prepare: gather indices and mask for SDPA, next to
nothing for the kernel), one call timed with CUDA events around it (host launch overhead included: an eager
step), and the same call replayed from a CUDA graph, 10 per graph (device time only: a decode step's graph),
each the median of --repeats after warm-up; and the largest absolute difference between the two outputs.
Blocks are handed out shuffled, as a serving cache's are.  The JSON (--out) is rewritten after every shape, so
a run cut short keeps what it measured; shapes stop starting after --budget-s.

GPU:  python3 bench/attention_kernel.py --out $OUT/attention-kernel-h200.json
CPU dry run (Triton's interpreter, tiny shapes):
      python3 bench/attention_kernel.py --device cpu --batches 2 --contexts 40 --queries 1,3 --heads 4,2,32 \
          --repeats 2 --out /tmp/attention-kernel.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.common import environment, write_json  # noqa: E402
from specdec.models import attention  # noqa: E402
from specdec.models.attention import AttentionBatch  # noqa: E402

GRAPH_CALLS = 10  # calls per captured graph: replay time / 10 is one call's device time


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/attention-kernel-h200.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", default="1,8,32,64,128")
    parser.add_argument("--contexts", default="512,2048,8192")
    parser.add_argument("--queries", default="1,8", help="queries per sequence (1 decode, k + 1 verify)")
    parser.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head_dim")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=80.0, help="no new shape starts after this")
    return parser.parse_args(argv)


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def make_step(batch: int, context: int, queries: int, heads: int, kv_heads: int, head_dim: int,
              block_size: int, dtype: torch.dtype, device: torch.device):
    """A uniform step (every sequence `queries` new tokens at context `context`) over shuffled blocks:
    q [batch * queries, H, D], k/v caches [slots, Hkv, D], and the step's unprepared AttentionBatch."""
    per_seq = -(-context // block_size)
    num_blocks = batch * per_seq + 1
    tables = torch.randperm(num_blocks, device=device)[:batch * per_seq].view(batch, per_seq)
    shape = (num_blocks * block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, device=device, dtype=dtype)
    v_cache = torch.randn(shape, device=device, dtype=dtype)
    q = torch.randn(batch * queries, heads, head_dim, device=device, dtype=dtype)
    offsets = torch.arange(context - queries, context, device=device)  # [queries] positions of the new tokens
    slots = (tables.gather(1, (offsets // block_size).expand(batch, -1)) * block_size + offsets % block_size)

    def step() -> AttentionBatch:
        return AttentionBatch(torch.arange(0, batch * queries + 1, queries, device=device),
                              torch.full((batch,), context, device=device), tables, slots.flatten(), queries,
                              context, uniform=True)

    return q, k_cache, v_cache, step


def median_ms(fn, device: torch.device, repeats: int, warmup: int) -> float:
    """Median of one call timed with CUDA events (perf_counter on a CPU), after warm-up."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def graph_ms(fn, device: torch.device, repeats: int) -> float | None:
    """Device time of one call: GRAPH_CALLS calls captured in one CUDA graph, median replay / GRAPH_CALLS."""
    if device.type != "cuda":
        return None
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()  # warm-up outside the graph
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    ms = median_ms(graph.replay, device, repeats, warmup=2) / GRAPH_CALLS
    del graph
    return ms


def measure(fn, device, args) -> dict:
    row = {"ms": median_ms(fn, device, args.repeats, args.warmup)}
    try:
        row["graph_ms"] = graph_ms(fn, device, args.repeats)
    except RuntimeError as error:  # a path that cannot be captured: keep the eager time
        row["graph_error"] = str(error).splitlines()[0][:200]
    return row


def one_shape(batch, context, queries, heads, kv_heads, head_dim, kernel, device, dtype, args) -> dict:
    scale = head_dim ** -0.5
    q, k_cache, v_cache, step = make_step(batch, context, queries, heads, kv_heads, head_dim, args.block_size,
                                          dtype, device)
    row = {"batch": batch, "context": context, "queries": queries}
    attention.set_attention_backend("sdpa")
    gathered = step().prepare(args.block_size)
    reference = attention.paged_attention(q, k_cache, v_cache, gathered, scale)  # also builds the cached bias
    row["sdpa_prepare_ms"] = median_ms(lambda: step().prepare(args.block_size), device, args.repeats, 1)
    row["sdpa"] = measure(lambda: attention.paged_attention(q, k_cache, v_cache, gathered, scale), device, args)
    attention.set_attention_backend("triton")  # on a GPU, prepare then skips the gather indices and mask
    row["kernel_prepare_ms"] = median_ms(lambda: step().prepare(args.block_size), device, args.repeats, 1)
    attention.set_attention_backend("sdpa")

    def run_kernel():
        return kernel.paged_attention(q, k_cache, v_cache, gathered.query_start, gathered.context_lens,
                                      gathered.block_tables, args.block_size, scale, queries, context)

    out = run_kernel()
    row["max_abs_diff"] = (out.float() - reference.float()).abs().max().item()
    row["kernel"] = measure(run_kernel, device, args)
    row["splits"] = kernel.split_plan(batch, kv_heads, context, device, 64)[0]
    for path in ("sdpa", "kernel"):
        if row[path].get("graph_ms"):
            row[f"{path}_graph_ms"] = row[path]["graph_ms"]
    if row.get("sdpa_graph_ms") and row.get("kernel_graph_ms"):
        row["speedup_graph"] = row["sdpa_graph_ms"] / row["kernel_graph_ms"]
    row["speedup_eager"] = row["sdpa"]["ms"] / row["kernel"]["ms"]
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":  # the kernel runs under Triton's interpreter (set before triton is imported)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from specdec.kernels import paged_attention as kernel

    dtype = getattr(torch, args.dtype)
    heads, kv_heads, head_dim = ints(args.heads)
    began = time.perf_counter()
    result = {"env": environment(device), "shape": f"{heads} query / {kv_heads} KV heads x {head_dim}",
              "dtype": args.dtype, "block_size": args.block_size, "graph_calls": GRAPH_CALLS, "rows": []}
    for batch in ints(args.batches):
        for context in ints(args.contexts):
            for queries in ints(args.queries):
                if time.perf_counter() - began > args.budget_s:
                    result.setdefault("stopped", f"budget {args.budget_s} s reached before batch {batch} context {context}")
                    break
                try:
                    row = one_shape(batch, context, queries, heads, kv_heads, head_dim, kernel, device, dtype, args)
                except (RuntimeError, torch.OutOfMemoryError) as error:
                    row = {"batch": batch, "context": context, "queries": queries,
                           "error": str(error).splitlines()[0][:300]}
                result["rows"].append(row)
                print(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
                               if not isinstance(v, dict)), flush=True)
                write_json(args.out, result)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    attention.set_attention_backend("sdpa")
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
