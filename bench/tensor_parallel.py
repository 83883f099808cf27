#!/usr/bin/env python3
"""Tensor-parallel decode step time at Qwen3-8B shape (random weights): batch 1 and 32, one TP size per launch.

GPU run (one launch per size; rank 0 writes the JSON):
    python3 bench/tensor_parallel.py --out bench/results/tp1-h200.json
    torchrun --nproc-per-node 2 bench/tensor_parallel.py --tp 2 --out bench/results/tp2-h200.json
    torchrun --nproc-per-node 4 bench/tensor_parallel.py --tp 4 --out bench/results/tp4-h200.json
CPU dry run:
    torchrun --nproc-per-node 2 bench/tensor_parallel.py --tp 2 --tiny --out /tmp/tp2.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.common import environment, write_json  # noqa: E402
from bench.decode import QWEN3_8B, TINY, decode_step_ms, make_engine, start_requests  # noqa: E402
from specdec.models.config import ModelConfig  # noqa: E402
from specdec.models.loader import default_dtype, random_model  # noqa: E402
from specdec.parallel.tensor_parallel import init_tensor_parallel, rank_device, shard_model  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (launch with torchrun when > 1)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (CPU dry run)")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    raw = TINY if args.tiny else QWEN3_8B
    tp = init_tensor_parallel(args.tp) if args.tp > 1 else None
    device = torch.device(rank_device("auto", tp) if tp else ("cuda" if torch.cuda.is_available() else "cpu"))
    model = random_model(ModelConfig.from_dict(raw), device, default_dtype(device), seed=0)
    if tp is not None:
        shard_model(model, tp.rank, tp.world_size)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        engine = make_engine(model, batch, args.context, kv_tokens=batch * (args.context + args.steps + 64) + 4096)
        start_requests(engine, batch, args.context, raw["vocab_size"], torch.Generator().manual_seed(batch))
        ms = decode_step_ms(engine, args.steps)
        rows.append({"batch": batch, "context": args.context, "step_ms": ms, "tok_s": batch * 1e3 / ms,
                     "graph_replays": engine.runner.static.replays if engine.runner.static else 0})
        del engine
        if tp is None or tp.rank == 0:
            print(rows[-1], flush=True)
    if tp is None or tp.rank == 0:
        write_json(args.out, {"tensor_parallel_size": args.tp, "model": "tiny" if args.tiny else "qwen3-8b-shape",
                              "rows": rows, "environment": environment(device)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
