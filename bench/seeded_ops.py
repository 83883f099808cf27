#!/usr/bin/env python3
"""What seeding costs a step in operations: the PyTorch operations a step runs, counted by the profiler, for
sampled requests with a seed each (as the judge sends them) against the same requests without, for plain and for
speculative (EAGLE-3) steps (issue 20's team and busy loads).  A seeded request draws its uniforms from its own
generator, one call of its own and the copies into the step's buffers (specdec/verify.py _draw_uniforms, the
head's chain uniforms), where unseeded rows share two calls; on a GPU each of those is a kernel launch outside
the step's graphs.

CPU:  python3 bench/seeded_ops.py --out bench/results/seeded-ops-cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from bench.common import environment, write_json  # noqa: E402
from specdec import LLM, SamplingParams  # noqa: E402
from specdec.assets import heldout_prompts_path  # noqa: E402
from specdec.speculate import SpecConfig  # noqa: E402

COUNTED = ("aten::rand", "aten::copy_")


def ops_per_step(llm: LLM, prompts: list[str], seeded: bool, max_tokens: int) -> dict:
    """{"steps", "ops": all aten operations a step, and each of COUNTED a step} over one generate call."""
    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i if seeded else None, ignore_eos=True)
              for i in range(len(prompts))]
    before = llm.engine.stats["steps"]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    steps = llm.engine.stats["steps"] - before
    counts = {event.key: event.count for event in prof.key_averages()}
    row = {"steps": steps, "ops": round(sum(n for k, n in counts.items() if k.startswith("aten::")) / steps, 1)}
    return row | {name: round(counts.get(name, 0) / steps, 1) for name in COUNTED}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="ref-target")
    parser.add_argument("--head", default="ref-head")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--batches", default="16,64")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    prompts = [json.loads(line)["prompt"] for line in heldout_prompts_path().read_text().splitlines()]
    rows = []
    for steps in ("plain", f"eagle3 k={args.k}"):
        spec = None if steps == "plain" else SpecConfig("eagle3", model=args.head, num_draft_tokens=args.k,
                                                         adaptive=False)
        llm = LLM(args.target, device="cpu", kv_cache_tokens=60000, speculator=spec)
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=1.0), use_tqdm=False)  # first use
        for batch in (int(b) for b in args.batches.split(",")):
            for seeded in (False, True):
                rows.append({"steps_of": steps, "batch": batch, "seeded": seeded,
                             **ops_per_step(llm, prompts[:batch], seeded, args.max_tokens)})
                print(rows[-1], flush=True)
    write_json(args.out, {"environment": environment(torch.device("cpu")), "target": args.target,
                          "head": args.head, "k": args.k, "max_tokens": args.max_tokens, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
