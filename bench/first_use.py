#!/usr/bin/env python3
"""What an engine builds on first use after its start-up, under loads shaped as the judge's: torch.compile
variants of the elementwise pieces, Triton binaries of specdec.kernels, CUDA graphs of the target's steps and
of their fixed-shape acceptance (its keys: counted on a CPU too, where nothing is captured), per phase
(a warm-up batch, then solo, team and busy passes).  Each one built inside a served request stalls it
(0.2-1 s for a compile on a GPU); after a complete start-up every count past `start-up` is 0.

On a GPU the engine starts as a server's does (graphs precaptured, then the eager warm-up of
engine/eager_warm_up.py unless --no-warm-up).  On a CPU nothing is compiled on first use by default, so the
pieces are compiled there with dynamo's eager backend (which variant a call needs is dynamo's guards'
decision, as on a GPU) and the start-up is run as a GPU's: precapture run eagerly, then the warm-up.

CPU:  python3 bench/first_use.py --device cpu --target ref-hybrid --speculator mtp --out /tmp/first-use.json
GPU:  python3 bench/first_use.py --target ref-hybrid --target-twin qwen3.5-27b --speculator mtp
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.common import compiles, environment, triton_compiles, write_json  # noqa: E402
from specdec import LLM, SamplingParams  # noqa: E402
from specdec.assets import heldout_prompts_path  # noqa: E402
from specdec.models import fused  # noqa: E402
from specdec.speculate import SpecConfig  # noqa: E402

# (phase, requests, concurrency, max_tokens): the judge's default sizes (8 prompts; team 16 lanes; busy longer)
PHASES = [("warm-up", 8, 8, 8)] + [(f"{name} {p}", n, c, t) for p in (1, 2, 3)
                                   for name, n, c, t in (("solo", 8, 1, 48), ("team", 16, 16, 48),
                                                         ("busy", 24, 24, 64))]


def graphs_captured(llm: LLM) -> int:
    """CUDA graphs the target's fixed-shape runner holds (0 on a CPU)."""
    static = llm.engine.runner.static
    return len(static.graphs) if static is not None else 0


def acceptance_keys(llm: LLM) -> int:
    """Fixed-shape acceptance keys made so far: on a GPU each is a CUDA graph, captured when first met."""
    static = llm.engine.runner.static
    return len(static.acceptance.shapes) if static is not None and static.acceptance is not None else 0


def counts(llm: LLM) -> dict:
    return {"compiled": compiles(), "triton": triton_compiles(), "cuda_graphs": graphs_captured(llm),
            "acceptance_keys": acceptance_keys(llm)}


def start(args, device: torch.device) -> LLM:
    spec = {"mtp": SpecConfig("mtp", num_draft_tokens=args.k),
            "eagle3": SpecConfig("eagle3", model=args.head, num_draft_tokens=args.k, draft_twin=args.head_twin or None),
            "ngram": SpecConfig("ngram", num_draft_tokens=args.k), "": None}[args.speculator]
    options = dict(static_shapes=True, fixed_acceptance=True, max_num_seqs=24, kv_cache_tokens=args.kv_cache_tokens,
                   max_model_len=2048, device=device, twin=args.target_twin or None, warm_up=args.warm_up)
    if device.type == "cuda":
        return LLM(args.target, speculator=spec, **options)
    fused.use_compiled(fused.compile_all("eager"))  # the pieces as a GPU runs them, with dynamo's eager backend
    with torch.inference_mode():  # a GPU's start-up order: precapture, the warm-up, then calibration
        llm = LLM(args.target, speculator=spec, precapture=False, **options)
        llm.engine.precapture_graphs(eager=True)
        if args.warm_up:
            llm.engine.warm_up_eager(force=True)
    return llm


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/first-use.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--target", default="ref-hybrid")
    parser.add_argument("--target-twin", default="", help="a twin shape of the target (e.g. qwen3.5-27b)")
    parser.add_argument("--speculator", default="mtp", choices=("mtp", "eagle3", "ngram", ""))
    parser.add_argument("--head", default="ref-head", help="the EAGLE-3 head (--speculator eagle3)")
    parser.add_argument("--head-twin", default="", help="the head's twin shape (that of its target)")
    parser.add_argument("--k", type=int, default=2, help="the most drafts a step (adaptive)")
    parser.add_argument("--kv-cache-tokens", type=int, default=4096)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=True,
                        help="run the engine's eager warm-up at start-up (as a server does)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    t0 = time.perf_counter()
    llm = start(args, device)
    rows = [{"phase": "start-up", "seconds": time.perf_counter() - t0, **counts(llm)}]
    prompts = [json.loads(line)["prompt"] for line in open(heldout_prompts_path())][:args.prompts]
    for phase, n, concurrency, max_tokens in PHASES:
        before, t0 = counts(llm), time.perf_counter()
        params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1000 * len(rows) + i) for i in range(n)]
        for i in range(0, n, concurrency):
            batch = [prompts[j % len(prompts)] for j in range(i, min(n, i + concurrency))]
            llm.generate(batch, params[i:i + concurrency])
        after = counts(llm)
        rows.append({"phase": phase, "seconds": time.perf_counter() - t0,
                     **{key: after[key] - before[key] for key in after}})
    print(f"{'phase':<10} {'seconds':>8} {'compiled':>8} {'triton':>6} {'graphs':>6} {'acceptance':>10}")
    for row in rows:
        print(f"{row['phase']:<10} {row['seconds']:8.2f} {row['compiled']:8d} {row['triton']:6d} "
              f"{row['cuda_graphs']:6d} {row['acceptance_keys']:10d}")
    built = sum(row["compiled"] + row["triton"] + row["cuda_graphs"] + row["acceptance_keys"] for row in rows[1:])
    write_json(args.out, {"env": environment(device), "args": vars(args), "rows": rows, "built_after_start_up": built})
    return 0


if __name__ == "__main__":
    sys.exit(main())
