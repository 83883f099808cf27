#!/usr/bin/env python3
"""Scaled twins on the GPU: greedy agreement with the small model in bf16, and step time against a
random-weight model of the same shape.

GPU run:      python3 bench/twin.py --out bench/results/twin-h200.json
CPU dry run:  python3 bench/twin.py --device cpu --shape '{"hidden_size": 512, ...}' --prompts 2 --out /tmp/twin.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.common import environment, write_json  # noqa: E402
from bench.decode import decode_step_ms, make_engine, start_requests  # noqa: E402
from specdec import LLM, SamplingParams  # noqa: E402
from specdec.assets import heldout_prompts_path  # noqa: E402
from specdec.engine.engine import Engine, EngineConfig  # noqa: E402
from specdec.models.loader import random_model  # noqa: E402
from specdec.models.twin import make_twin  # noqa: E402


def greedy_agreement(small_llm: LLM, twin, prompts: list[str], max_tokens: int) -> dict:
    """Per-position argmax agreement of the twin with the small model along the small model's greedy text."""
    outs = small_llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0))
    engine = Engine(twin, EngineConfig(kv_cache_tokens=8192, static_shapes=False))
    agree = total = 0
    for out in outs:
        ids = out.prompt_token_ids + out.token_ids
        logits = engine.all_logits(ids[:-1])[len(out.prompt_token_ids) - 1:]  # predicts out.token_ids
        pred = logits.argmax(-1).tolist()
        agree += sum(p == t for p, t in zip(pred, out.token_ids))
        total += len(out.token_ids)
    return {"agreement": agree / max(1, total), "positions": total}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/twin-h200.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--pairs", default="ref-target:qwen3-8b,ref-draft:qwen3-0.6b")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    prompts = [json.loads(x)["prompt"] for x in heldout_prompts_path().read_text().splitlines()[:args.prompts]]
    results = {"env": environment(device), "twins": []}
    for pair in args.pairs.split(","):
        name, shape = pair.split(":")
        small = LLM(name, device=device, kv_cache_tokens=8192)  # not from free memory: the twin comes next
        twin = make_twin(small.model, shape, noise=1e-6)
        row = {"model": f"{name} as {shape} twin", **greedy_agreement(small, twin, prompts, args.max_tokens)}
        vocab = small.model.config.vocab_size
        for label, model in (("twin", twin), ("random", random_model(twin.config, device, twin.lm_head.weight.dtype))):
            for batch in (1, 32):
                engine = make_engine(model, batch, 512, batch * 1200 + 1024)
                start_requests(engine, batch, 512, vocab, torch.Generator().manual_seed(0))
                row[f"{label}_step_ms_bs{batch}"] = decode_step_ms(engine, args.steps)
                del engine
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
        for batch in (1, 32):
            row[f"step_ratio_bs{batch}"] = row[f"twin_step_ms_bs{batch}"] / row[f"random_step_ms_bs{batch}"]
        results["twins"].append(row)
        print(json.dumps(row), flush=True)
        del twin, small
    write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
