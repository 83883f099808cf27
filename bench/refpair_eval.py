#!/usr/bin/env python3
"""Re-measure the shipped reference pair on a CPU and update its record (after a drafter is replaced).

Figures (float32, CPU, deterministic):
  - held-out loss / perplexity of both models on the text of the shipped held-out prompts (prefixes of
    held-out files: text neither model was trained on), the same tokens for both;
  - the drafter's greedy tau at k = 4, 7, 16 and its per-token agreement, teacher-forced on the target's
    greedy continuations of those prompts (bench/results/ref-target-heldout.jsonl);
  - parameter counts and checkpoint sizes.
The record keeps the training run's own figures; this run's go under the same keys (the headline ones)
and under "cpu_eval".

Usage: python3 bench/refpair_eval.py [--drafter-run RUN_JSON] [--out bench/results/reference-pair.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from specdec.assets import ASSETS_DIR, heldout_prompts_path, resolve_model  # noqa: E402
from specdec.train.distill import acceptance_tau, draft_matches, load_model  # noqa: E402


def text_loss(model, tokenizer, texts: list[str], max_tokens: int = 512) -> tuple[float, int]:
    """Mean next-token cross-entropy over the texts (each cut to max_tokens), and the tokens scored."""
    total, count = 0.0, 0
    for text in texts:
        ids = torch.tensor([tokenizer.encode(text).ids[:max_tokens]], device=next(model.parameters()).device)
        if ids.shape[1] < 2:
            continue
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].float()  # [T-1, V]
        total += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
        count += ids.shape[1] - 1
    return total / count, count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--heldout", default=str(REPO / "bench" / "results" / "ref-target-heldout.jsonl"))
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "reference-pair.json"))
    parser.add_argument("--note", default="", help="what changed (kept in the record)")
    args = parser.parse_args(argv)
    from tokenizers import Tokenizer

    t0 = time.monotonic()
    torch.manual_seed(0)
    target_dir, draft_dir = resolve_model("ref-target"), resolve_model("ref-draft")
    tokenizer = Tokenizer.from_file(str(target_dir / "tokenizer.json"))
    target, draft = load_model(target_dir, "cpu"), load_model(draft_dir, "cpu")
    texts = [json.loads(line)["prompt"] for line in heldout_prompts_path().read_text().splitlines()]
    conversations = [json.loads(line) for line in Path(args.heldout).read_text().splitlines()]

    ev: dict = {"device": "cpu", "dtype": "float32", "torch": torch.__version__, "note": args.note}
    target_loss, ev["heldout_eval_tokens"] = text_loss(target, tokenizer, texts)
    ev["target_heldout_loss"] = round(target_loss, 4)
    ev["draft_heldout_loss"] = round(text_loss(draft, tokenizer, texts)[0], 4)
    for who in ("target", "draft"):
        ev[f"{who}_heldout_ppl"] = round(math.exp(ev[f"{who}_heldout_loss"]), 3)
    matches = draft_matches(draft, [c["prompt"] for c in conversations], [c["continuation"] for c in conversations])
    ev["draft_token_match"] = round(float(np.mean(np.concatenate(matches))), 4)
    for k in (4, 7, 16):
        ev[f"tau_k{k}"] = round(acceptance_tau(matches, k), 3)
    ev["heldout_conversations"] = len(conversations)
    ev["draft_params"] = sum(p.numel() for p in draft.parameters())
    ev["target_params"] = sum(p.numel() for p in target.parameters())
    ev["sizes_bytes"] = {d.name: sum(f.stat().st_size for f in d.iterdir()) for d in (target_dir, draft_dir)}
    ev["seconds"] = round(time.monotonic() - t0, 1)

    out = Path(args.out)
    record = json.loads(out.read_text()) if out.is_file() else {}
    record["cpu_eval"] = ev
    for key in ("target_params", "draft_params", "target_heldout_loss", "draft_heldout_loss", "target_heldout_ppl",
                "draft_heldout_ppl", "draft_token_match", "tau_k4", "tau_k7", "tau_k16", "sizes_bytes"):
        record[key] = ev[key]
    record["heldout_eval"] = (f"cpu_eval: {ev['heldout_eval_tokens']} tokens of the shipped held-out prompts; "
                              "tau on the target's greedy continuations of them")
    text = json.dumps(record, indent=1) + "\n"
    out.write_text(text)
    (ASSETS_DIR / "reference-pair.json").write_text(text)
    print(json.dumps(ev, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
