#!/usr/bin/env python3
"""Sanity figures of a pre-trained hybrid (Qwen3.5-shaped) target, e.g. a ref-hybrid candidate (issue 22).

  - held-out loss / perplexity on the text of the shipped held-out prompts (float32), beside ref-target's on
    the same tokens when --compare names it (same tokenizer);
  - the engine's greedy continuations (specdec.LLM, float32) against transformers' greedy generate on the
    same checkpoint: prompts that match exactly, and the mean length of the agreeing prefix.

Usage: python3 bench/hybrid_check.py --model DIR [--compare ref-target] [--out record.json] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch  # noqa: E402
from refpair_eval import text_loss  # noqa: E402

from specdec import LLM, SamplingParams  # noqa: E402
from specdec.assets import heldout_prompts_path, resolve_model  # noqa: E402
from specdec.train.distill import load_model  # noqa: E402
from specdec.train.lm import pick_device  # noqa: E402


def heldout_loss(model_dir: Path, texts: list[str], device: torch.device) -> dict:
    """Held-out loss and perplexity of one checkpoint (float32) on ``texts``."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    loss, count = text_loss(load_model(model_dir, device, torch.float32), tokenizer, texts)
    return {"heldout_loss": round(loss, 4), "heldout_ppl": round(math.exp(loss), 3), "heldout_tokens": count}


def greedy_agreement(model_dir: Path, texts: list[str], new_tokens: int, device: torch.device) -> dict:
    """The engine's greedy continuations against transformers' ``generate`` (both float32)."""
    llm = LLM(model_dir, device=str(device), dtype="float32")
    prompts = [llm.encode(text)[-256:] for text in texts]
    outs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
    hf = load_model(model_dir, device, torch.float32)
    prefixes = []
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids], device=device), max_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        prefixes.append(next((i for i, (a, b) in enumerate(zip(out.token_ids, ref)) if a != b), len(ref)))
    return {"prompts": len(prompts), "new_tokens": new_tokens, "exact": sum(p == new_tokens for p in prefixes),
            "mean_agreeing_prefix": round(sum(prefixes) / len(prefixes), 2),
            "sample": texts[0][-200:] + "\u2588" + outs[0].text}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="the hybrid checkpoint directory")
    parser.add_argument("--compare", default=None, help="another checkpoint with the same tokenizer (ref-target)")
    parser.add_argument("--n-prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", default=None, help="write the record here (JSON)")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    device = pick_device(args.device)
    texts = [json.loads(line)["prompt"] for line in heldout_prompts_path().read_text().splitlines()]
    model_dir = resolve_model(args.model)
    record = {"model": str(args.model), "config": json.loads((model_dir / "config.json").read_text()),
              "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
              "commit": os.environ.get("SPECDEC_COMMIT"), "hybrid": heldout_loss(model_dir, texts, device)}
    if args.compare:
        record["compare"] = {"model": args.compare, **heldout_loss(resolve_model(args.compare), texts, device)}
    record["greedy_vs_transformers"] = greedy_agreement(model_dir, texts[:args.n_prompts], args.new_tokens, device)
    record["seconds"] = round(time.monotonic() - t0, 1)
    text = json.dumps(record, indent=1) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    print(json.dumps({k: v for k, v in record.items() if k != "config"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
