#!/usr/bin/env python3
"""What an eager (non-CUDA-graph) step costs, with the compiled elementwise pieces and with the plain ones.

Steps that mix prefill with decoding, or verify shapes outside the captured graphs, run eagerly.  Under load
they are a large share of an engine's time (issue 4: 23 eager steps of 19 ms were 45 % of plain decoding's
time at concurrency 64 on the reference pair), and speculation makes more of them.  For each model and step
shape: the median time of the target's forward with the compiled pieces (what the engine runs), with the plain
ones (`specdec.models.fused.plain_kernels`), and through piecewise graphs (`engine/piecewise.py`: everything but
attention replayed as CUDA graphs per token bucket).

GPU:  python3 bench/eager_steps.py --out $OUT/eager-steps-h200.json
CPU dry run:  python3 bench/eager_steps.py --device cpu --twin "" --out /tmp/eager.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.common import environment, timed, write_json  # noqa: E402
from specdec import LLM, SamplingParams  # noqa: E402
from specdec.engine.piecewise import PiecewiseRunner  # noqa: E402
from specdec.engine.request import Request  # noqa: E402
from specdec.engine.scheduler import ScheduledSeq  # noqa: E402
from specdec.models.fused import Kernels, plain_kernels  # noqa: E402

# name -> (decoding sequences, drafts each, prefilling sequences, prompt tokens each)
SHAPES = {
    "c16 decode + 2 prefills": (14, 0, 2, 60),
    "c64 decode + 25 prefills": (56, 0, 25, 60),
    "c64 verify k8 + 8 prefills": (56, 8, 8, 60),
    "prefill 512": (0, 0, 1, 512),
    "prefill 2048": (0, 0, 1, 2048),
}
CONTEXT = 120  # tokens already in the cache of each decoding sequence


def scratch_step(llm: LLM, shape) -> tuple[list[ScheduledSeq], list[Request]]:
    """Scheduled sequences of the given shape on freshly allocated blocks (release them after)."""
    decoding, drafts, prefilling, prompt = shape
    blocks, device = llm.engine.blocks, llm.device
    seqs, held = [], []
    for i in range(decoding + prefilling):
        decode = i < decoding
        tokens = CONTEXT + 1 + drafts if decode else prompt
        req = Request([1 + i % 100] * tokens, SamplingParams(max_tokens=1), device)
        req.block_ids = blocks.allocate(blocks.blocks_for(tokens))
        if req.block_ids is None:
            raise SystemExit(f"KV cache too small for {shape}")
        if decode:
            req.num_computed = CONTEXT
            req.draft_token_ids = [2] * drafts
        held.append(req)
        new = 1 + drafts if decode else prompt
        seqs.append(ScheduledSeq(req, new, drafts if decode else 0, samples=True))
    return seqs, held


def time_shapes(llm: LLM, repeats: int) -> list[dict]:
    rows = []
    runner = llm.engine.runner
    most = max(d * (1 + k) + p * t for d, k, p, t in SHAPES.values())  # tokens of the widest step
    piecewise = PiecewiseRunner(llm.model, llm.device, most, capture=True)
    piecewise.capture_all()
    for name, shape in SHAPES.items():
        seqs, held = scratch_step(llm, shape)
        row = {"shape": name, "tokens": sum(s.num_new for s in seqs)}
        try:
            before = runner.eager_forwards
            row["compiled_ms"] = 1e3 * timed(lambda: runner.forward(seqs), llm.device, repeats=repeats, warmup=2)
            row["eager"] = runner.eager_forwards > before
            with plain_kernels():
                row["plain_ms"] = 1e3 * timed(lambda: runner.forward(seqs), llm.device, repeats=repeats, warmup=2)
            runner.piecewise = piecewise
            row["piecewise_ms"] = 1e3 * timed(lambda: runner.forward(seqs), llm.device, repeats=repeats, warmup=2)
        finally:
            runner.piecewise = None
            for req in held:
                llm.engine.blocks.release(req.block_ids)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/eager-steps-h200.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="ref-target")
    parser.add_argument("--twin", default="qwen3-8b", help="also time the model as this twin ('' for none)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    results = {"env": environment(device), "models": []}
    for twin in [None] + ([args.twin] if args.twin else []):
        llm = LLM(args.model, device=device, twin=twin, kv_cache_tokens=32768, max_num_seqs=64)
        name = f"{args.model} as {twin} twin" if twin else args.model
        print(name, "fused pieces in use:", Kernels.fused, flush=True)
        results["models"].append({"model": name, "fused": Kernels.fused, "rows": time_shapes(llm, args.repeats)})
        write_json(args.out, results)
        del llm
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
