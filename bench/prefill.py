#!/usr/bin/env python3
"""Prefill steps of a team-like batch (several prompts of ragged lengths arriving together): wall time per
step, eager and with piecewise graphs, a Gated DeltaNet's sequences laid end to end in the Triton kernel or in
padded groups with the chunked PyTorch form, and where the device time goes (the costliest kernels by their own
device time, torch.profiler).  The 27B twin's team load spent half its time in two such steps (issue 22).

Each timed run prefills new prompts (fresh ids: no prefix is reused) and emits --max-tokens per prompt (1: the
prefill step alone; 2 with a speculator: its head's observe of the prompts and the first draft chain too).

CPU:  python3 bench/prefill.py --device cpu --target ref-hybrid --twin "" --out /tmp/prefill.json
GPU:  python3 bench/prefill.py --target ref-hybrid --twin qwen3.5-27b --out "$OUT/prefill-twin27b.json"
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.common import alloc_retries, environment, free_device_memory, sync, write_json  # noqa: E402
from specdec import LLM, SamplingParams  # noqa: E402
from specdec.models import gated_deltanet  # noqa: E402
from specdec.speculate import SpecConfig  # noqa: E402

# name -> (EngineConfig.piecewise_graphs, gated_deltanet.RAGGED_IN_KERNEL: a step's sequences laid end to end in one
# launch of the Triton kernel where it runs, else padded groups, the long ones in the chunked PyTorch form)
VARIANTS = {"eager": (False, True), "piecewise": (True, True), "eager-chunked": (False, False),
            "piecewise-chunked": (True, False)}


def prompt_lengths(prompts: int, tokens: int) -> list[int]:
    """`prompts` ragged lengths summing to `tokens`, the longest ~3x the shortest: 4 prompts of 400 tokens
    -> [50, 83, 117, 150]-ish scaled to 400 (what arrives together in a team pass)."""
    weights = [1 + 2 * i / max(prompts - 1, 1) for i in range(prompts)]
    lengths = [max(1, int(tokens * w / sum(weights))) for w in weights]
    lengths[-1] += tokens - sum(lengths)
    return lengths


def fresh_prompts(lengths: list[int], seed: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (n,), generator=generator).tolist() for n in lengths]


def own_time_ms(event) -> float:
    """An operator's own device time (its own CPU time where there is no GPU)."""
    if not torch.cuda.is_available():
        return event.self_cpu_time_total / 1e3
    total = getattr(event, "self_device_time_total", None)
    return (total if total is not None else event.self_cuda_time_total) / 1e3


def kernel_table(llm: LLM, prompts: list[list[int]], params: SamplingParams, top: int) -> dict:
    """One more run under torch.profiler: the `top` operators / kernels by their own time (ms)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as profiler:
        llm.generate(prompts, params)
    events = [e for e in profiler.key_averages() if own_time_ms(e) > 0]
    events.sort(key=own_time_ms, reverse=True)
    return {"own_ms": round(sum(own_time_ms(e) for e in events), 2),
            "top": [{"name": e.key[:120], "calls": e.count, "ms": round(own_time_ms(e), 3)}
                    for e in events[:top]]}


def measure(variant: str, args, device: torch.device, lengths: list[int]) -> dict:
    piecewise, gated_deltanet.RAGGED_IN_KERNEL = VARIANTS[variant]
    started = time.perf_counter()
    speculator = SpecConfig(args.speculator, num_draft_tokens=args.num_draft_tokens, adaptive=False) \
        if args.speculator else None
    llm = LLM(args.target, twin=args.twin or None, device=device, piecewise_graphs=piecewise, speculator=speculator,
              max_num_seqs=len(lengths), kv_cache_tokens=args.kv_cache_tokens, max_model_len=args.max_model_len)
    built_s = time.perf_counter() - started
    vocab = min(llm.engine.model.config.vocab_size, 1000)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(fresh_prompts(lengths, 0, vocab), params)  # first use: warm what the start-up left cold
    seconds, steps, retries = [], [], alloc_retries(device)
    for run in range(args.repeats):
        prompts = fresh_prompts(lengths, 1 + run, vocab)
        before = llm.engine.stats["steps"]
        sync(device)
        t = time.perf_counter()
        llm.generate(prompts, params)
        sync(device)
        seconds.append(time.perf_counter() - t)
        steps.append(llm.engine.stats["steps"] - before)
    row = {"variant": variant, "built_s": round(built_s, 1), "steps_per_run": steps,
           "run_ms": [round(s * 1e3, 1) for s in seconds],
           "median_ms": round(sorted(seconds)[len(seconds) // 2] * 1e3, 1),
           "alloc_retries": alloc_retries(device) - retries}
    if args.top:
        row["profile"] = kernel_table(llm, fresh_prompts(lengths, 99, vocab), params, args.top)
    del llm
    free_device_memory(device)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/prefill.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--target", default="ref-hybrid")
    parser.add_argument("--twin", default="qwen3.5-27b", help="the target's twin shape ('' for none)")
    parser.add_argument("--prompts", type=int, default=12, help="prompts arriving together")
    parser.add_argument("--tokens", type=int, default=2048, help="their tokens in all")
    parser.add_argument("--variants", default="eager,piecewise,eager-chunked", help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--max-tokens", type=int, default=1, help="tokens emitted per prompt (1: the prefill alone)")
    parser.add_argument("--speculator", default="", help="a speculator of the target's own (mtp), or none")
    parser.add_argument("--num-draft-tokens", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--top", type=int, default=25, help="kernels kept from one profiled run (0: no profile)")
    parser.add_argument("--kv-cache-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=2048)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    lengths = prompt_lengths(args.prompts, args.tokens)
    record = {"env": environment(device), "target": f"{args.target} as {args.twin or 'itself'}",
              "speculator": f"{args.speculator} k={args.num_draft_tokens}" if args.speculator else None,
              "max_tokens": args.max_tokens,
              "prompt_lengths": lengths, "rows": []}
    for variant in args.variants.split(","):
        row = measure(variant, args, device, lengths)
        record["rows"].append(row)
        print(f"{variant}: median {row['median_ms']} ms over {row['steps_per_run']} steps a run "
              f"(runs {row['run_ms']}); built in {row['built_s']} s", flush=True)
        for kernel in row.get("profile", {}).get("top", [])[:12]:
            print(f"   {kernel['ms']:9.3f} ms {kernel['calls']:6d}x  {kernel['name']}", flush=True)
        write_json(args.out, record)
    gated_deltanet.RAGGED_IN_KERNEL = True
    return 0


if __name__ == "__main__":
    sys.exit(main())
