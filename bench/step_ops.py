#!/usr/bin/env python3
"""How many PyTorch operators an eager engine step dispatches: the host's share of a step that runs without
CUDA graphs (Qwen3.5 hybrids today).  Each operator costs the host some microseconds to dispatch and launch
whatever the device does, so a step of N operators cannot be faster than about N x that, however fast the
kernels are; a twin has the same operators per layer as its small model, times its layers.

Counts the top-level aten operators (not those called inside another) over a few decode steps of one greedy
request, plain and with a speculator, on the CPU profiler (no GPU needed: the count is the code's, not the
device's).

Usage:  python3 bench/step_ops.py --model ref-hybrid --speculator mtp --out bench/results/step-ops-ref-hybrid-cpu.json
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from torch.profiler import ProfilerActivity, profile  # noqa: E402

from bench.common import environment, write_json  # noqa: E402
from specdec import LLM, SamplingParams  # noqa: E402
from specdec.speculate import SpecConfig  # noqa: E402


def top_level_ops(prof) -> collections.Counter:
    """aten operators not called from inside another aten operator."""
    return collections.Counter(e.name for e in prof.events() if e.name.startswith("aten::")
                               and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))


def ops_per_step(model: str, speculator: SpecConfig | None, steps: int, static_shapes: bool = False) -> dict:
    llm = LLM(model, device="cpu", speculator=speculator, cuda_graphs=False, static_shapes=static_shapes)
    engine = llm.engine
    engine.add_request(llm.encode("import os\nimport sys\n"),
                       SamplingParams(max_tokens=8 * steps, temperature=0, ignore_eos=True))
    for _ in range(4):  # past the prefill
        engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    counts = top_level_ops(prof)
    layers = llm.model.config.num_hidden_layers
    return {"ops_per_step": round(sum(counts.values()) / steps, 1), "layers": layers,
            "ops_per_layer_step": round(sum(counts.values()) / steps / layers, 1),
            "most_common": {name: round(n / steps, 1) for name, n in counts.most_common(10)}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="ref-hybrid")
    parser.add_argument("--speculator", default="mtp", help="a speculator beside plain decoding ('' for none)")
    parser.add_argument("--num-draft-tokens", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--static-shapes", action="store_true",
                        help="the padded fixed-shape steps: the operators a CUDA graph of the step holds (on a GPU "
                             "the host replays it instead of dispatching them)")
    parser.add_argument("--out", default="bench/results/step-ops-ref-hybrid-cpu.json")
    args = parser.parse_args(argv)
    import torch

    record = {"environment": environment(torch.device("cpu")), "model": args.model,
              "static_shapes": args.static_shapes, "rows": {}}
    configs = {"plain": None}
    if args.speculator:
        configs[f"{args.speculator}-k{args.num_draft_tokens}"] = SpecConfig(
            args.speculator, num_draft_tokens=args.num_draft_tokens, adaptive=False)
    for name, config in configs.items():
        record["rows"][name] = ops_per_step(args.model, config, args.steps, args.static_shapes)
        print(name, record["rows"][name], flush=True)
    write_json(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
