#!/usr/bin/env python3
"""Does training a head on T = 1 acceptance itself, instead of the KL to the target, lift its T = 1 acceptance?

A draft drawn from q is kept at T = 1 with probability sum_x min(p(x), q(x)).  `specdec train head` minimises
the cross-entropy to p (the KL up to a constant), which a head of limited capacity meets by covering p's mass;
1 - sum min(p, q) (the total variation) is the acceptance itself.  Here one head (default: ref-head) is trained
on for the same steps, on the same batches, once per objective (`kl`, `tv`, or `mixN`: tv + N/10 x kl), on the
target's continuations of corpus prompts (half greedy, half T = 1, as `specdec train head` makes them); each
result is measured as bench/head_overlap.py measures heads (sum min(p, q) per draft position, teacher-forced,
on held-out prompts followed by the target's own T = 1 samples), beside the head it started from.

CPU:  python3 bench/head_objective.py --corpus /tmp/hx/corpus --out /tmp/objective.json
(the corpus: python -m specdec.data.corpus --out /tmp/hx/corpus --max-bytes 30000000 --heldout-fraction 0.03 --seed 0)
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
from bench.head_overlap import contexts, overlap  # noqa: E402
from specdec import LLM, SamplingParams  # noqa: E402
from specdec.assets import resolve_model  # noqa: E402
from specdec.models.eagle3 import feature_layers, load_eagle3_head, save_eagle3_head  # noqa: E402
from specdec.models.loader import load_model  # noqa: E402
from specdec.train.data import load_prompt_sources  # noqa: E402
from specdec.train.head import SequenceBatcher, TargetSignals  # noqa: E402
from specdec.train.head_loss import head_loss  # noqa: E402
from specdec.train.head_unroll import Eagle3Unroll  # noqa: E402


def continuations(target: str, corpus: str, count: int, tokens: int) -> list:
    """The target's continuations of `count` train-split prompts, alternately greedy and at T = 1 (seeded)."""
    prompts, _ = load_prompt_sources([corpus], resolve_model(target), count, 32, 256, seed=1)
    llm = LLM(target, device="cpu")
    params = [SamplingParams(max_tokens=tokens, temperature=float(i % 2), seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    outs = llm.generate([p["prompt"] for p in prompts], params, use_tqdm=False)
    return [torch.tensor(list(p["prompt"]) + list(o.token_ids)).numpy() for p, o in zip(prompts, outs)]


def objective_loss(objective: str, unroll, embed, features, target_logprobs, lengths, steps: int) -> torch.Tensor:
    """The loss of one batch: kl (specdec's head_loss), tv (1 - sum min(p, q) per position, masked and weighted
    per step as head_loss weights the cross-entropy), or mixN (tv + N/10 x the cross-entropy)."""
    row_loss = None
    if objective != "kl":
        mix = float(objective[3:]) / 10 if objective.startswith("mix") else 0.0
        row_loss = lambda logits, logprobs: step_loss(logprobs.exp(), logits, mix)  # noqa: E731
    return head_loss(unroll, embed, features, target_logprobs, lengths, steps, fused=False, row_loss=row_loss)[0]


def step_loss(p: torch.Tensor, logits: torch.Tensor, mix: float = 0.0) -> torch.Tensor:
    """Per row, 1 - sum_x min(p(x), q(x)) with q = softmax(logits) (one minus the T = 1 acceptance of a draft
    drawn from q), plus mix x the cross-entropy -sum p log q: p, logits [..., V] -> [...]."""
    log_q = logits.float().log_softmax(-1)
    loss = 1 - torch.minimum(p, log_q.exp()).sum(-1)
    return loss - mix * (p * log_q).sum(-1) if mix else loss


class HeadTraining:
    """A head loaded to be trained on further on `sequences` (CPU, float32): each step takes the target's
    signals for a batch and one optimizer step on an objective_loss; betas and clip are AdamW's and the gradient
    norm's (None: not clipped)."""

    def __init__(self, head_dir: Path, target_dir: Path, sequences, seq_len: int, batch: int, lr: float,
                 betas: tuple[float, float] = (0.9, 0.999), clip: float | None = None):
        target = load_model(target_dir, "cpu", torch.float32)
        self.head = load_eagle3_head(head_dir, target, torch.device("cpu"), torch.float32).requires_grad_(True)
        self.head.train()
        self.signals = TargetSignals(str(target_dir), torch.device("cpu"),
                                     feature_layers(self.head.config, target.config.num_hidden_layers))
        self.unroll, self.batcher = Eagle3Unroll(self.head), SequenceBatcher(sequences, seq_len, batch, seed=0)
        self.opt = torch.optim.AdamW([p for p in self.head.parameters() if p.requires_grad], lr=lr,
                                     weight_decay=0.0, betas=betas)
        self.clip = clip

    def step(self, objective: str, ttt_steps: int) -> None:
        ids, lengths, _ = self.batcher.next(torch.device("cpu"))
        embed, features, target_logprobs = self.signals(ids, self.head.target_ids())
        loss = objective_loss(objective, self.unroll, embed, features, target_logprobs, lengths, ttt_steps)
        self.opt.zero_grad()
        loss.backward()
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.head.parameters(), self.clip)
        self.opt.step()

    def save(self, out_dir: Path) -> None:
        """The head as it is now, in the published layout (training goes on after)."""
        save_eagle3_head(self.head.eval(), out_dir)
        self.head.train()


def train_on(head_dir: Path, target_dir: Path, objective: str, sequences, steps: int, lr: float, batch: int,
             seq_len: int, ttt_steps: int, out_dir: Path) -> float:
    """Train the head on for `steps` steps (the same batches for every objective); save it to out_dir; seconds."""
    training = HeadTraining(head_dir, target_dir, sequences, seq_len, batch, lr)
    started = time.perf_counter()
    for _ in range(steps):
        training.step(objective, ttt_steps)
    training.save(out_dir)
    return time.perf_counter() - started


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="ref-target")
    parser.add_argument("--head", default="ref-head")
    parser.add_argument("--corpus", required=True, help="a corpus directory (specdec.data.corpus)")
    parser.add_argument("--objectives", default="kl,tv")
    parser.add_argument("--sequences", type=int, default=400, help="training continuations")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=352)
    parser.add_argument("--prompts", type=int, default=24, help="held-out prompts measured on")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    target, head = resolve_model(args.target), resolve_model(args.head)
    sequences = continuations(args.target, args.corpus, args.sequences, 96)
    convs = contexts(args.target, args.prompts, "t1", 64)
    result = {"environment": environment(torch.device("cpu")), "target": args.target, "head": args.head,
              "sequences": len(sequences), "steps": args.steps, "lr": args.lr, "batch": args.batch,
              "rows": {"start": [round(x[0], 4) for x in overlap(head, target, convs, [1.0], 3)]}}
    print("start", result["rows"]["start"], flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for objective in args.objectives.split(","):
            out_dir = Path(tmp) / objective
            seconds = train_on(head, target, objective, sequences, args.steps, args.lr, args.batch, args.seq_len, 7,
                               out_dir)
            result["rows"][objective] = [round(x[0], 4) for x in overlap(out_dir, target, convs, [1.0], 3)]
            print(objective, result["rows"][objective], f"{seconds:.0f} s", flush=True)
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
