#!/usr/bin/env python3
"""Do overlapped steps (engine/overlap.py) give plain decoding's tokens on this device?  Greedy and seeded
sampled replies of the held-out prompts from one engine with overlapped steps and one without (both with fixed
acceptance, which overlapped steps need), compared token for token, with each engine's tokens per second.
tests/test_overlap_steps.py checks the same on a CPU, where every copy is synchronous; on a GPU the step behind
really runs while the host commits, so this is the check that the stream ordering holds there.

GPU:  python3 bench/overlap_equal.py --out $OUT/overlap-equal-h200.json
CPU dry run (tiny, no twin):  python3 bench/overlap_equal.py --device cpu --target-twin "" --prompts 3 --tokens 8 \\
          --out /tmp/overlap-equal.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import environment, sync, write_json  # noqa: E402
from specdec import LLM, SamplingParams  # noqa: E402
from specdec.assets import heldout_prompts_path  # noqa: E402


def replies(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> tuple[list[list[int]], float]:
    """Each prompt's reply tokens, all decoding together, and the tokens per second of that batch."""
    llm.generate(prompts[:1], params[:1])  # warm-up
    sync(llm.device)
    start = time.perf_counter()
    outputs = [o.token_ids for o in llm.generate(prompts, params)]
    sync(llm.device)
    return outputs, sum(map(len, outputs)) / (time.perf_counter() - start)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/overlap-equal-h200.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--target", default="ref-target")
    parser.add_argument("--target-twin", default="qwen3-8b")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    prompts = [json.loads(line)["prompt"] for line in heldout_prompts_path().read_text().splitlines()[:args.prompts]]
    settings = {"greedy": [SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)] * len(prompts),
                "sampled": [SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=i, ignore_eos=True)
                            for i in range(len(prompts))]}
    results = {"env": environment(device), "target": f"{args.target} as {args.target_twin} twin",
               "prompts": len(prompts), "tokens": args.tokens, "rows": []}
    outputs = {}
    for overlap in (False, True):
        llm = LLM(args.target, device=device, twin=args.target_twin or None, static_shapes=True,
                  fixed_acceptance=True, overlap_steps=overlap, max_num_seqs=len(prompts),
                  kv_cache_tokens=4096 * len(prompts), max_model_len=2048)
        for name, params in settings.items():
            before = llm.engine.stats["overlapped_steps"]
            outputs[overlap, name], tok_s = replies(llm, prompts, params)
            row = {"overlap": overlap, "replies": name, "tok_s": tok_s,
                   "overlapped_steps": llm.engine.stats["overlapped_steps"] - before}
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
        del llm
        if device.type == "cuda":
            torch.cuda.empty_cache()
    results["equal"] = {name: outputs[False, name] == outputs[True, name] for name in settings}
    print("equal:", results["equal"], flush=True)
    write_json(args.out, results)
    return 0 if all(results["equal"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
