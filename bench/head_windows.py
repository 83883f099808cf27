#!/usr/bin/env python3
"""Does fresh corpus text lift a trained head's T = 1 acceptance where its continuations do not (issue 20)?

One head (default ref-head) is trained on for --steps steps with specdec's loss (the cross-entropy to the
target's distribution over --ttt-steps unrolled steps), from the same start, once per arm:
  - windows: fresh windows of the corpus's train documents (`specdec train head --corpus-windows`'s data), each
    seen once;
  - continuations: the target's continuations of 400 corpus prompts (half greedy, half T = 1), seen many times,
    as a head's continuations are in a run on the GPU.
Every --every steps the head is measured as bench/head_overlap.py measures heads: sum min(p, q) per draft
position, teacher-forced, on held-out prompts followed by the target's own T = 1 samples (no sampling noise).

CPU:  python3 bench/head_windows.py --corpus /tmp/hx/corpus --out /tmp/head-windows.json   (~35 min an arm)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.common import environment, write_json  # noqa: E402
from bench.head_objective import HeadTraining, continuations  # noqa: E402
from bench.head_overlap import contexts, overlap  # noqa: E402
from specdec.assets import resolve_model  # noqa: E402
from specdec.train.data import corpus_windows  # noqa: E402


def arm_sequences(arm: str, args, target_dir: Path) -> list:
    if arm == "windows":
        windows, _ = corpus_windows([args.corpus], target_dir, args.steps * args.batch, args.seq_len, seed=5)
        return [w["window"].astype("int64") for w in windows]
    return continuations(args.target, args.corpus, 400, 96)


def train_arm(arm: str, args, target_dir: Path, head_dir: Path, convs: list) -> list[dict]:
    """[{step, overlap [3], seconds}] every args.every steps of training the head on the arm's sequences."""
    training = HeadTraining(head_dir, target_dir, arm_sequences(arm, args, target_dir), args.seq_len, args.batch,
                            args.lr, betas=(0.9, 0.95), clip=1.0)
    rows, started = [], time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for step in range(1, args.steps + 1):
            training.step("kl", args.ttt_steps)
            if step % args.every == 0:
                training.save(Path(tmp) / "head")
                measured = [round(x[0], 4) for x in overlap(Path(tmp) / "head", target_dir, convs, [1.0], 3)]
                rows.append({"step": step, "overlap": measured, "seconds": round(time.perf_counter() - started)})
                print(arm, rows[-1], flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="ref-target")
    parser.add_argument("--head", default="ref-head")
    parser.add_argument("--corpus", required=True, help="a corpus directory (specdec.data.corpus)")
    parser.add_argument("--arms", default="windows,continuations")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--prompts", type=int, default=24, help="held-out prompts measured on")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    target_dir, head_dir = resolve_model(args.target), resolve_model(args.head)
    convs = contexts(args.target, args.prompts, "t1", 64)
    result = {"environment": environment(torch.device("cpu")), "settings": vars(args),
              "start": [round(x[0], 4) for x in overlap(head_dir, target_dir, convs, [1.0], 3)], "arms": {}}
    for arm in args.arms.split(","):
        result["arms"][arm] = train_arm(arm, args, target_dir, head_dir, convs)
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
