#!/usr/bin/env python3
"""What a head's T = 1 acceptance is, without sampling noise: sum over tokens of min(p, q) per draft position.

At temperature 1 a draft drawn from q is kept with probability sum_x min(p(x), q(x)) (1 - total variation), so
this is the expected acceptance of each draft position, computed exactly from the distributions along given
contexts instead of counted from sampled chains.  Contexts: the bundled held-out prompts followed by the
target's greedy continuations (`greedy`) or by its own samples at T = 1 (`t1`, what the judge samples).  The
head is unrolled teacher-forced on the context (train/head_loss.py unrolled_logits), as in training; its q is
softmax(logits / tau) for each tau asked (tau = 1: as drafted; another tau is a sharpened or flattened q, which
rejection sampling would keep lossless too).

CPU:  python3 bench/head_overlap.py --heads ref-head --prompts 16 --contexts t1 --out /tmp/overlap.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.common import environment, write_json  # noqa: E402
from specdec import LLM, SamplingParams  # noqa: E402
from specdec.assets import resolve_model  # noqa: E402
from specdec.drafting.heldout import load_heldout  # noqa: E402
from specdec.models.eagle3 import feature_layers, load_eagle3_head  # noqa: E402
from specdec.models.loader import load_model  # noqa: E402
from specdec.train.head import TargetSignals  # noqa: E402
from specdec.train.head_loss import unrolled_logits  # noqa: E402
from specdec.train.head_unroll import Eagle3Unroll  # noqa: E402

HELDOUT = REPO / "bench" / "results" / "ref-target-heldout.jsonl"


def contexts(target: str, count: int, kind: str, tokens: int) -> list[dict]:
    """[{prompt, continuation}] token ids: the held-out set's greedy continuations, or the target's T = 1 samples."""
    rows = load_heldout(HELDOUT, count)
    if kind == "greedy":
        return rows
    llm = LLM(target, device="cpu")
    params = [SamplingParams(max_tokens=tokens, temperature=1.0, seed=i, ignore_eos=True) for i in range(len(rows))]
    outs = llm.generate([r["prompt"] for r in rows], params, use_tqdm=False)
    return [dict(prompt=r["prompt"], continuation=o.token_ids) for r, o in zip(rows, outs)]


@torch.no_grad()
def overlap(head_dir: Path, target_dir: Path, convs: list[dict], taus: list[float], steps: int) -> list[list[float]]:
    """[steps][taus]: the mean over continuation tokens of sum min(p, q_tau) at each draft position."""
    target = load_model(target_dir, "cpu", torch.float32)
    head = load_eagle3_head(head_dir, target, torch.device("cpu"), torch.float32).eval()
    signals = TargetSignals(str(target_dir), torch.device("cpu"), feature_layers(head.config, target.config.num_hidden_layers))
    total, count = torch.zeros(steps, len(taus)), torch.zeros(steps)
    for conv in convs:
        seq = list(conv["prompt"]) + list(conv["continuation"])
        embed, features, target_logprobs = signals(torch.tensor([seq]), head.target_ids())
        logits = unrolled_logits(Eagle3Unroll(head), embed, features, steps)  # per step [1, T, V_draft]
        p = target_logprobs.exp()[0]  # [T, V_draft]: the target's distribution of the token each row drafts
        first, end = len(conv["prompt"]) - 2, len(seq) - 2  # roots predicting continuation tokens
        for s in range(steps):
            rows = slice(max(first, s), end)
            for j, tau in enumerate(taus):
                q = (logits[s][0, rows].float() / tau).softmax(-1)
                total[s, j] += torch.minimum(p[rows], q).sum()
            count[s] += end - max(first, s)
    return (total / count[:, None]).tolist()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="ref-target")
    parser.add_argument("--heads", default="ref-head", help="comma-separated head directories or short names")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--contexts", default="greedy,t1")
    parser.add_argument("--tokens", type=int, default=96, help="tokens sampled per prompt for t1 contexts")
    parser.add_argument("--taus", default="0.5,0.6,0.7,0.8,1.0")
    parser.add_argument("--steps", type=int, default=3, help="draft positions")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    target = resolve_model(args.target)
    taus = [float(t) for t in args.taus.split(",")]
    result = {"environment": environment(torch.device("cpu")), "target": args.target, "prompts": args.prompts,
              "taus": taus, "rows": {}}
    for kind in args.contexts.split(","):
        convs = contexts(args.target, args.prompts, kind, args.tokens)
        for head in args.heads.split(","):
            rows = overlap(resolve_model(head), target, convs, taus, args.steps)
            result["rows"][f"{head} / {kind}"] = [[round(x, 4) for x in row] for row in rows]
            print(head, kind, result["rows"][f"{head} / {kind}"][0], flush=True)
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
