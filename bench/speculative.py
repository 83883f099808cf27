#!/usr/bin/env python3
"""Speculation against plain decoding on the reference pair: tokens/s and tokens per verify step at
concurrency 1, 16 and 64, with the draft and n-gram speculators; transformers' assisted generation
with the same pair as the peer at batch 1.

GPU run:      python3 bench/speculative.py --out bench/results/speculative-h200.json
CPU dry run:  python3 bench/speculative.py --device cpu --concurrency 1,4 --max-tokens 16 --out /tmp/spec.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.common import compiles, environment, sync, write_json  # noqa: E402
from specdec import LLM, SamplingParams  # noqa: E402
from specdec.assets import heldout_prompts_path, short_name_path  # noqa: E402
from specdec.speculate import SpecConfig  # noqa: E402

CONFIGS = {
    "plain": None,
    "draft-adaptive-k8": SpecConfig("draft", model="ref-draft", num_draft_tokens=8),
    "draft-k4": SpecConfig("draft", model="ref-draft", num_draft_tokens=4, adaptive=False),
    "ngram-adaptive-k8": SpecConfig("ngram", num_draft_tokens=8),
    "ngram-k4": SpecConfig("ngram", num_draft_tokens=4, adaptive=False),
}


def load_prompts(n: int) -> list[str]:
    lines = heldout_prompts_path().read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines[:n]]


def run_load(llm: LLM, prompts: list[str], params: SamplingParams) -> dict:
    before = dict(llm.engine.metrics())
    compiles_before = compiles()
    sync(llm.device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    sync(llm.device)
    seconds = time.perf_counter() - t0
    after = llm.engine.metrics()
    tokens = sum(len(o.token_ids) for o in outs)
    steps = after["verify_steps"] - before["verify_steps"]
    drafted = after["draft_tokens"] - before["draft_tokens"]
    delta = {key: after.get(key, 0) - before.get(key, 0) for key in ("steps", "eager_forwards",
                                                                    "draft_forwards", "draft_eager_forwards")}
    return {"tok_s": tokens / seconds, "seconds": seconds, "tokens": tokens,
            "tokens_per_verify_step": tokens / max(1, steps), **delta,
            "compiles": compiles() - compiles_before,
            "acceptance": (after["accepted_tokens"] - before["accepted_tokens"]) / max(1, drafted),
            "draft_tokens": drafted, "outputs": [o.token_ids for o in outs]}


def transformers_peer(device: torch.device, prompts: list[str], max_tokens: int) -> dict:
    import transformers

    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    target = transformers.AutoModelForCausalLM.from_pretrained(short_name_path("ref-target"), dtype=dtype).to(device)
    draft = transformers.AutoModelForCausalLM.from_pretrained(short_name_path("ref-draft"), dtype=dtype).to(device)
    tok = transformers.AutoTokenizer.from_pretrained(short_name_path("ref-target"))
    out = {}
    for name, kwargs in (("hf_plain_bs1", {}), ("hf_assisted_bs1", {"assistant_model": draft})):
        tokens, t0 = 0, None
        for i, p in enumerate(prompts):
            ids = tok(p, return_tensors="pt").input_ids.to(device)
            if i == 1:  # the first prompt warms up
                sync(device)
                t0 = time.perf_counter()
            gen = target.generate(ids, max_new_tokens=max_tokens, do_sample=False, pad_token_id=0, **kwargs)
            if i >= 1:
                tokens += gen.shape[1] - ids.shape[1]
        sync(device)
        out[name] = {"tok_s": tokens / (time.perf_counter() - t0), "tokens": tokens}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/speculative-h200.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    results = {"env": environment(device), "max_tokens": args.max_tokens, "loads": []}
    plain_outputs = {}
    for name in args.configs.split(","):
        for c in concurrency:
            prompts = load_prompts(max(3 * c, 12))  # longer timed windows than 2c: the 2c ones lasted 0.2-0.8 s
            # an explicit KV size: sized from free memory, a later engine would find what earlier ones kept
            llm = LLM("ref-target", device=device, speculator=CONFIGS[name], max_num_seqs=c, kv_cache_tokens=32768)
            run_load(llm, prompts, params)  # warm-up: graph capture for every shape this load meets
            row = run_load(llm, prompts, params)
            outputs = row.pop("outputs")
            if name == "plain":
                plain_outputs[c] = outputs
            else:
                same = sum(a == b for a, b in zip(outputs, plain_outputs.get(c, [])))
                row["identical_to_plain"] = f"{same}/{len(outputs)}"
                row["speedup"] = row["tok_s"] / next(r["tok_s"] for r in results["loads"]
                                                     if r["config"] == "plain" and r["concurrency"] == c)
            row.update(config=name, concurrency=c)
            results["loads"].append(row)
            print(json.dumps(row), flush=True)
            write_json(args.out, results)  # kept if a time limit ends the run early
            del llm
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    results.update(transformers_peer(device, load_prompts(9), args.max_tokens))
    print({k: v for k, v in results.items() if k.startswith("hf_")})
    write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
