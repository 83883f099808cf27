#!/usr/bin/env python3
"""The Triton gated delta rule (specdec/kernels/delta_rule.py, `fused_recurrent`) against the PyTorch recurrent
form (specdec/models/delta_rule.py, `recurrent` after repeat_interleave of q and k, as gated_deltanet.py calls
it), one Gated DeltaNet layer at the Qwen3.5-27B shape (16 key heads, 48 value heads, Dk = Dv = 128, float32
state), for batch x tokens per sequence (1 decode, k + 1 verify).

Per shape and path: one call timed with CUDA events around it (host launch overhead included: an eager step)
and the same call replayed from a CUDA graph, 10 per graph (device time only), each the median of --repeats
after warm-up (the timing helpers of bench/attention_kernel.py); the kernel also with counts and no outputs
(the state advance after a verify), and per --block-v value.  Bandwidth is counted against the state bytes
alone, B * H * Dk * Dv * 4 read + the same written (q, k, v, g, beta and the outputs are a few percent more at
T <= 4), next to a large copy's for the ceiling.  The JSON (--out) is rewritten after every shape.

The pool paths time the step as the layer runs it on its state pool [B + 2, H, Dk, Dv] (slots in random
order): `gathered` gathers the slots' rows, runs the kernel and scatters the finals back (the layer before
the slot-indexed mode), `in_place` runs the kernel on the pool through the slots; `*_deferred` is a deferred
verify step (no store: the gather + kernel against the in-place read).  pool_speedup is gathered / in_place
(graph times), pool_max_abs_diff the largest difference of their outputs and pools.

GPU:  python3 bench/delta_rule_kernel.py --out $OUT/delta-rule-kernel-h100.json
CPU dry run (Triton's interpreter, tiny shapes):
      python3 bench/delta_rule_kernel.py --device cpu --batches 1 --tokens 1,2 --heads 1,2,16,16 --repeats 1 \
          --warmup 0 --out /tmp/delta-rule-kernel.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.attention_kernel import GRAPH_CALLS, ints, measure  # noqa: E402
from bench.common import copy_bandwidth_gbs, environment, write_json  # noqa: E402
from specdec.models.delta_rule import l2_normalize, recurrent  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/delta-rule-kernel-h100.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", default="1,8,16,32")
    parser.add_argument("--tokens", default="1,2,4", help="tokens per sequence (1 decode, k + 1 verify)")
    parser.add_argument("--heads", default="16,48,128,128", help="key heads, value heads, Dk, Dv")
    parser.add_argument("--block-v", default="32", help="state columns per program, one timing each")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    return parser.parse_args(argv)


def make_inputs(batch: int, tokens: int, key_heads: int, heads: int, dk: int, dv: int, device: torch.device):
    """(q, k [B, T, Hk, Dk], v [B, T, H, Dv], g, beta [B, T, H], state [B, H, Dk, Dv]) as the layer makes them."""
    q = l2_normalize(torch.randn(batch, tokens, key_heads, dk, device=device)) * dk ** -0.5
    k = l2_normalize(torch.randn(batch, tokens, key_heads, dk, device=device))
    v = torch.randn(batch, tokens, heads, dv, device=device)
    g = -torch.rand(batch, tokens, heads, device=device)
    beta = torch.rand(batch, tokens, heads, device=device)
    state = torch.randn(batch, heads, dk, dv, device=device)
    return q, k, v, g, beta, state


def state_gbs(row: dict, state_bytes: int) -> float | None:
    """GB/s of the state read + written in a path's device time (graph replay; the eager call without one)."""
    ms = row.get("graph_ms") or row["ms"]
    return 2 * state_bytes / (ms * 1e-3) / 1e9


def pool_paths(inputs, kernel, block_v: int) -> tuple[dict, float]:
    """({name: call} of the gathered and in-place steps on a pool of B + 2 random states, their largest
    difference): q, k, v, g, beta as inputs, the slots a random choice of B distinct pool rows."""
    q, k, v, g, beta, state = inputs
    batch = state.shape[0]
    pool = torch.randn(batch + 2, *state.shape[1:], device=state.device)  # [N, H, Dk, Dv]
    slots = torch.randperm(batch + 2, device=state.device)[:batch]

    def gathered(target=pool, store=True):
        out, final = kernel.fused_recurrent(q, k, v, g, beta, target[slots], block_v=block_v)
        if store:
            target[slots] = final
        return out

    def in_place(target=pool, store=True):
        return kernel.fused_recurrent(q, k, v, g, beta, target, slots=slots, store=store, block_v=block_v)[0]

    pools = pool.clone(), pool.clone()
    diff = max((gathered(pools[0]) - in_place(pools[1])).abs().max().item(), (pools[0] - pools[1]).abs().max().item())
    paths = {"gathered": gathered, "in_place": in_place, "gathered_deferred": lambda: gathered(store=False),
             "in_place_deferred": lambda: in_place(store=False)}
    return paths, diff


def one_shape(batch, tokens, key_heads, heads, dk, dv, kernel, device, args) -> dict:
    inputs = make_inputs(batch, tokens, key_heads, heads, dk, dv, device)
    q, k, v, g, beta, state = inputs
    repeat = heads // key_heads
    counts = torch.full((batch,), tokens, device=device)
    state_bytes = state.numel() * state.element_size()
    row = {"batch": batch, "tokens": tokens, "state_mb": state_bytes / 1e6}

    def torch_path():
        return recurrent(q.repeat_interleave(repeat, 2), k.repeat_interleave(repeat, 2), v, g, beta, state)

    paths = {"torch": torch_path}
    for block_v in ints(args.block_v):
        paths[f"kernel_bv{block_v}"] = lambda bv=block_v: kernel.fused_recurrent(*inputs, block_v=bv)
        paths[f"advance_bv{block_v}"] = lambda bv=block_v: kernel.fused_recurrent(
            *inputs, counts, write_outputs=False, block_v=bv)
    expected_out, expected_final = torch_path()
    out, final = paths[f"kernel_bv{ints(args.block_v)[0]}"]()
    row["max_abs_diff"] = max((out - expected_out).abs().max().item(), (final - expected_final).abs().max().item())
    for name, fn in paths.items():
        row[name] = measure(fn, device, args)
        row[name]["state_gbs"] = state_gbs(row[name], state_bytes)
    fastest = min((row[name].get("graph_ms") or row[name]["ms"], name) for name in paths if name != "torch")
    row["best"] = fastest[1]
    row["speedup_graph"] = (row["torch"].get("graph_ms") or row["torch"]["ms"]) / fastest[0]
    row["speedup_eager"] = row["torch"]["ms"] / row[fastest[1]]["ms"]
    pooled, row["pool_max_abs_diff"] = pool_paths(inputs, kernel, ints(args.block_v)[0])
    for name, fn in pooled.items():
        row[name] = measure(fn, device, args)
        row[name]["state_gbs"] = state_gbs(row[name], state_bytes)
    for suffix in ("", "_deferred"):
        gathered, in_place = row[f"gathered{suffix}"], row[f"in_place{suffix}"]
        row[f"pool_speedup{suffix}"] = (gathered.get("graph_ms") or gathered["ms"]) / \
            (in_place.get("graph_ms") or in_place["ms"])
    return row


def table_line(row: dict) -> str:
    """batch, tokens, then per path its graph (else eager) ms and state GB/s."""
    cells = [f"B {row['batch']:>3} T {row['tokens']:>2}"]
    for name, value in row.items():
        if isinstance(value, dict) and "ms" in value:
            ms = value.get("graph_ms") or value["ms"]
            cells.append(f"{name} {ms * 1e3:8.1f} us {value['state_gbs']:7.1f} GB/s")
    cells.append(f"x{row['speedup_graph']:.1f} (eager x{row['speedup_eager']:.1f}) diff {row['max_abs_diff']:.1e}")
    cells.append(f"in place x{row['pool_speedup']:.2f} (deferred x{row['pool_speedup_deferred']:.2f}) "
                 f"diff {row['pool_max_abs_diff']:.1e}")
    return " | ".join(cells)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":  # the kernel runs under Triton's interpreter (set before triton is imported)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from specdec.kernels import delta_rule as kernel

    key_heads, heads, dk, dv = ints(args.heads)
    result = {"env": environment(device), "shape": f"{key_heads} key / {heads} value heads, Dk {dk}, Dv {dv}",
              "graph_calls": GRAPH_CALLS, "block_v": ints(args.block_v),
              "launch": dict(zip(("dk_pad", "block_v", "num_warps"), kernel.launch_config(dk, dv))), "rows": []}
    if device.type == "cuda":
        result["copy_bandwidth_gbs"] = copy_bandwidth_gbs(device)
        print(f"copy bandwidth {result['copy_bandwidth_gbs']:.0f} GB/s")
    for batch in ints(args.batches):
        for tokens in ints(args.tokens):
            try:
                row = one_shape(batch, tokens, key_heads, heads, dk, dv, kernel, device, args)
                print(table_line(row), flush=True)
            except (RuntimeError, torch.OutOfMemoryError) as error:
                row = {"batch": batch, "tokens": tokens, "error": str(error).splitlines()[0][:300]}
                print(row, flush=True)
            result["rows"].append(row)
            write_json(args.out, result)
    result["finished"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
