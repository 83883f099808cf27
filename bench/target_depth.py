#!/usr/bin/env python3
"""How deep into the target its next-token distribution forms: the T = 1 acceptance a drafter with the target's
own first L layers would get, beside a head's and a separate drafter's (what bounds acceptance, issue 20).

For every continuation token of the given contexts (the held-out prompts followed by the target's own T = 1
samples, or its greedy continuations), with p the target's distribution of the next token:
  - early exit at layer L: q = softmax(lm_head(norm(h_L))) at the same position (the target's first L of its
    layers, with every earlier token and the current one in view, and no training for the exit), L = 1 .. N;
    at L = N this is the target itself, acceptance 1 (the measurement's own check);
  - a separate drafter (ref-draft): its q at the same position;
  - an EAGLE-3 head's first draft position (bench/head_overlap.py's measure, teacher-forced);
each as sum_x min(p(x), q(x)), the expected acceptance of a draft drawn from q at T = 1, with the target's
entropy and argmax probability on the same tokens.  No sampling noise; CPU float32.

CPU:  python3 bench/target_depth.py --prompts 24 --out bench/results/target-depth-cpu.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.common import environment, write_json  # noqa: E402
from bench.head_overlap import contexts, overlap  # noqa: E402
from specdec.assets import resolve_model  # noqa: E402
from specdec.train.distill import load_model  # noqa: E402


def continuation_rows(conv: dict) -> slice:
    """The positions whose next token is a continuation token: the prompt's last one predicts the first, the
    continuation's second-to-last its last (bench/head_overlap.py's head rows predict the same tokens)."""
    first = len(conv["prompt"]) - 1
    return slice(first, first + len(conv["continuation"]))


@torch.no_grad()
def depth_overlaps(target, drafter, convs: list[dict]) -> dict:
    """{"early_exit": [N] sum min(p, q_L) for L = 1 .. N, "drafter": float, "entropy", "argmax_p"}: means over
    the continuation tokens of convs."""
    layers = target.config.num_hidden_layers
    exits, drafted = torch.zeros(layers), 0.0
    entropy, argmax_p, count = 0.0, 0.0, 0
    for conv in convs:
        ids = torch.tensor([list(conv["prompt"]) + list(conv["continuation"])])
        rows = continuation_rows(conv)
        out = target(ids, output_hidden_states=True)
        p = out.logits[0, rows].float().softmax(-1)  # [T, V]
        # hidden_states[L] is the residual stream after L layers; the last one has the final norm applied
        for depth in range(1, layers + 1):
            h = out.hidden_states[depth][0, rows]
            h = h if depth == layers else target.model.norm(h)
            q = target.lm_head(h).float().softmax(-1)
            exits[depth - 1] += torch.minimum(p, q).sum()
        if drafter is not None:
            q = drafter(ids).logits[0, rows].float().softmax(-1)
            drafted += float(torch.minimum(p, q).sum())
        entropy += float(-(p * p.clamp_min(1e-30).log()).sum())
        argmax_p += float(p.max(-1).values.sum())
        count += p.shape[0]
    return {"early_exit": [round(float(x) / count, 4) for x in exits],
            "drafter": round(drafted / count, 4) if drafter is not None else None,
            "entropy_nats": round(entropy / count, 3), "argmax_p": round(argmax_p / count, 4), "tokens": count}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="ref-target")
    parser.add_argument("--drafter", default="ref-draft", help="a separate draft model ('' for none)")
    parser.add_argument("--head", default="ref-head", help="an EAGLE-3 head ('' for none)")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--contexts", default="t1,greedy")
    parser.add_argument("--tokens", type=int, default=96, help="tokens sampled per prompt for t1 contexts")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    target_dir = resolve_model(args.target)
    target = load_model(target_dir, "cpu", torch.float32)
    drafter = load_model(resolve_model(args.drafter), "cpu", torch.float32) if args.drafter else None
    result = {"environment": environment(torch.device("cpu")), "target": args.target, "drafter": args.drafter,
              "head": args.head, "prompts": args.prompts, "rows": {}}
    for kind in args.contexts.split(","):
        convs = contexts(args.target, args.prompts, kind, args.tokens)
        row = depth_overlaps(target, drafter, convs)
        if args.head:
            row["head_first_position"] = round(overlap(resolve_model(args.head), target_dir, convs, [1.0], 1)[0][0], 4)
        result["rows"][kind] = row
        print(kind, row, flush=True)
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
