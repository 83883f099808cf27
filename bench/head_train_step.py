#!/usr/bin/env python3
"""Where an EAGLE-3 head's training step goes: steps queued back to back as the training loop runs them, then
the target's signals, the unrolled loss, its backward and the optimizer timed apart (the device synchronised
between them), over random token rows of the training shape, and one step under the profiler, for the loss's
cross-entropy fused (one Triton launch) and plain (tensors); first, on CUDA, the fused one checked against the
plain one on one batch (issue 20).

GPU:  python3 bench/head_train_step.py --out $OUT/head-train-step-h100.json
CPU dry run:  python3 bench/head_train_step.py --device cpu --batch 2 --seq-len 64 --steps 2 --losses plain \
                --out /tmp/hts.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.common import environment, write_json  # noqa: E402
from specdec.assets import resolve_model  # noqa: E402
from specdec.models.fused import plain_kernels  # noqa: E402
from specdec.train.head import HeadRun, SequenceBatcher, eagle3_model  # noqa: E402
from specdec.train.head_loss import head_loss, soft_cross_entropy  # noqa: E402
from specdec.train.lm import autocast, make_optimizer  # noqa: E402

PARTS = ("signals", "loss", "backward", "optimizer")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="ref-target")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10, help="timed steps (after 3 warm-up steps)")
    parser.add_argument("--losses", default="fused,plain",
                        help="the loss's cross-entropy: fused (one Triton launch, the default on CUDA), plain (tensors)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    run = HeadRun(str(resolve_model(args.target)), [], "/tmp/head-train-step", batch_size=args.batch,
                  seq_len=args.seq_len)
    rng = np.random.default_rng(0)
    model = eagle3_model(run, [rng.integers(0, 8192, args.seq_len) for _ in range(256)], device)
    head, unroll, signals = model.module, model.unroll, model.signals
    optimizer = make_optimizer(head, 1e-3, 0.0, 0.95, device)
    batcher = SequenceBatcher([rng.integers(0, 8192, args.seq_len) for _ in range(256)], args.seq_len, args.batch, 0)
    draft_ids = unroll.target_ids()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    fused = None  # the loss's cross-entropy (head_loss's `fused`), set per measured variant below

    def step(mark=lambda: None) -> None:
        """One training step as the loop runs it; mark() after each part."""
        ids, lengths, _ = batcher.next(device)
        embed, features, target = signals(ids, draft_ids)
        mark()
        with autocast(device):
            loss, _ = head_loss(unroll, embed, features, target, lengths, args.ttt_steps, 0.8, fused)
        mark()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        mark()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        mark()

    def parts() -> list[float]:
        """Seconds of each part of one step, the device synchronised after each."""
        marks = [time.perf_counter()]

        def mark():
            sync()
            marks.append(time.perf_counter())
        step(mark)
        return [b - a for a, b in zip(marks, marks[1:])]

    def loop_ms() -> float:
        """A step's milliseconds in a run of them queued back to back (as the training loop, between logs)."""
        sync()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        sync()
        return (time.perf_counter() - start) * 1000 / args.steps

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    tokens = args.batch * args.seq_len
    record = {"environment": environment(device), "batch": args.batch, "seq_len": args.seq_len,
              "ttt_steps": args.ttt_steps, "losses": {},
              "loss_check": loss_check(signals, unroll, batcher, device) if device.type == "cuda" else None}
    print(record["loss_check"], flush=True)
    for name in args.losses.split(","):
        fused = name == "fused"
        with plain_kernels():
            for _ in range(3):
                step()
            times = np.array([parts() for _ in range(args.steps)]) * 1000  # [steps, parts] ms
            loop = loop_ms()
            with profile(activities=activities) as prof:
                step()
        table = prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=70)
        row = {"loop_step_ms": round(loop, 2), "tokens_per_s": round(tokens / loop * 1000),
               "parts_ms": {part: round(float(times[:, i].mean()), 2) for i, part in enumerate(PARTS)},
               "parts_sum_ms": round(float(times.sum(1).mean()), 2), "profile": table}
        record["losses"][name] = row
        print(table)
        print(name, {k: v for k, v in row.items() if k != "profile"}, flush=True)
        write_json(args.out, record)
    return 0


def loss_check(signals, unroll, batcher, device: torch.device) -> dict:
    """The fused cross-entropy against the tensor formula on one batch of real signals (random head logits of the
    draft vocabulary's width, in the autocast dtype): the largest differences of the loss and of its gradient."""
    ids, _, _ = batcher.next(device)
    _, _, target = signals(ids, unroll.target_ids())
    with autocast(device):
        logits = (torch.randn(target.shape, device=device) * 3).to(torch.bfloat16 if device.type == "cuda"
                                                                     else torch.float32)
    results = []
    for fused in (True, False):
        x = logits.clone().requires_grad_(True)
        ce = soft_cross_entropy(x, target, fused=fused)
        ce.sum().backward()
        results.append((ce.detach().float(), x.grad.float()))
    (ce_f, grad_f), (ce_p, grad_p) = results
    return {"ce_max_abs_diff": float((ce_f - ce_p).abs().max()), "ce_mean": float(ce_p.mean()),
            "grad_max_abs_diff": float((grad_f - grad_p).abs().max()), "grad_max": float(grad_p.abs().max())}


if __name__ == "__main__":
    sys.exit(main())
