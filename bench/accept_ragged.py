#!/usr/bin/env python3
"""The verify step's acceptance phase, before and after the ragged layout: time and bytes allocated.

Old: what the sampler did before (bench/padded_accept.py): an EAGLE-3 head's q mapped into the target
vocabulary, the target rows padded to [B, K+1, V], q (or a deterministic drafter's implied one-hot, only
built beside a drafter with q) padded to [B, K, V], then the padded acceptance.  New: the sampler's
ragged path, specdec.engine.sampler._draft_q + specdec.verify.accept_ragged, on the target rows as they
come out of the verify forward and q in the drafter's own vocabulary.

Beside them, the whole of the sampler's phase from the target's logits (processing, uniforms, acceptance, the
host copy): "sampler", today's ragged path (specdec.engine.sampler._sample_chains), and "fixed", acceptance on
the verify step's fixed shape (specdec.engine.fixed_acceptance.FixedAcceptance: one CUDA graph replay on a GPU),
and on a GPU "fused", the same with its fused kernel (specdec/kernels/accept.py; steps without top-p only).
Their logits are log(target), every row sampled at T = 1 (--top-p < 1 adds the cut and its sort to both).

Three drafters per batch size: "deterministic" (n-gram: no q), "draft model" (q over the target
vocabulary) and "eagle3" (q over a reduced draft vocabulary, the head's d2t).  Every row carries K drafts
sampled from q (or from the target row for the deterministic drafter); rows are unseeded (global RNG).
Bytes allocated: the sum of the sizes of the fresh tensors every operation returns (views and in-place
results excluded), counted by a dispatch mode on a separate, untimed run, so the figure is the same on any
device; on CUDA also the peak above the inputs.

CPU:  python3 bench/accept_ragged.py --device cpu --out /tmp/accept-ragged-cpu.json
GPU:  python3 bench/accept_ragged.py --device cuda --out $OUT/accept-ragged-h100.json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from bench.common import environment, sync, timed, write_json  # noqa: E402
from bench.padded_accept import pad_step, padded_accept  # noqa: E402
from specdec.engine.fixed_acceptance import FixedAcceptance  # noqa: E402
from specdec.engine.sampler import _draft_q, _sample_chains  # noqa: E402
from specdec.engine.scheduler import ScheduledSeq  # noqa: E402
from specdec.sampling import SamplingParams  # noqa: E402
from specdec.verify import accept_ragged, in_target_vocab  # noqa: E402

DRAFTERS = ("deterministic", "draft model", "eagle3")


@dataclasses.dataclass
class _Request:  # the fields of engine.request.Request that _draft_q reads
    draft_probs: torch.Tensor | None
    draft_vocab: torch.Tensor | None


@dataclasses.dataclass
class _Seq:  # the fields of engine.scheduler.ScheduledSeq that _draft_q reads
    request: _Request
    num_drafts: int


@dataclasses.dataclass
class Step:
    """One verify step's inputs as the sampler holds them."""

    target: torch.Tensor  # [B (K+1), V] processed target rows
    drafts: list[list[int]]  # [B][K] draft ids (target vocabulary)
    q: list[torch.Tensor | None]  # per row [K, V_q] or None
    draft_vocab: torch.Tensor | None  # [V_draft] eagle3's target ids


def make_step(drafter: str, batch: int, k: int, vocab: int, draft_vocab: int, device, seed: int = 0) -> Step:
    gen = torch.Generator(device=device).manual_seed(seed)
    target = torch.randn(batch * (k + 1), vocab, generator=gen, device=device).mul_(3).softmax(-1)  # [T, V]
    ids = torch.randperm(vocab, generator=gen, device=device)[:draft_vocab] if drafter == "eagle3" else None
    if drafter == "deterministic":
        rows = target.view(batch, k + 1, vocab)[:, :k].reshape(batch * k, vocab)
        drafts, q = torch.multinomial(rows, 1, generator=gen).view(batch, k), [None] * batch
    else:
        width = vocab if ids is None else draft_vocab
        logits = torch.randn(batch * k, width, generator=gen, device=device).mul_(3)
        q_all = logits.softmax(-1)  # [B K, V_q]
        drafts = torch.multinomial(q_all, 1, generator=gen).view(batch, k)
        drafts = drafts if ids is None else ids[drafts]
        q = list(q_all.split(k))
    return Step(target, drafts.tolist(), q, ids)


def old_step(step: Step) -> torch.Tensor:
    """[B, K+1] tokens, as the sampler did it before (eagle3 mapped its q into the target vocabulary)."""
    q = step.q
    if step.draft_vocab is not None:  # Eagle3Speculator._q_rows: the whole batch's rows at once
        mapped = in_target_vocab(torch.cat(q), step.target.shape[-1], step.draft_vocab)
        q = list(mapped.split([r.shape[0] for r in q]))
    counts = [len(d) for d in step.drafts]
    draft_ids, q_padded, target = pad_step(step.target, counts, step.drafts, q)
    return padded_accept(draft_ids, q_padded, target)


def new_step(step: Step):
    """(a [B], token [B]), as the sampler does it now."""
    seqs = [_Seq(_Request(q, None if q is None else step.draft_vocab), len(d)) for d, q in zip(step.drafts, step.q)]
    draft_ids = torch.tensor([t for d in step.drafts for t in d], dtype=torch.long)
    q = _draft_q(seqs, step.target.shape[-1], step.target.device)
    return accept_ragged(step.target, draft_ids, [len(d) for d in step.drafts], q)


def scheduled(step: Step, params: SamplingParams) -> list[ScheduledSeq]:
    """The step's rows as the engine's scheduled verify sequences (the request fields the sampler reads)."""
    return [ScheduledSeq(types.SimpleNamespace(
        params=params, draft_token_ids=d, draft_probs=q, draft_vocab=None if q is None else step.draft_vocab,
        draft_parents=None, generator=None), 1 + len(d), len(d), True) for d, q in zip(step.drafts, step.q)]


def sampler_step(step: Step, seqs: list[ScheduledSeq], logits: torch.Tensor) -> list[list[int]]:
    """Today's sampler on logits [B (K+1), V]: processing, then the ragged acceptance."""
    return _sample_chains(seqs, list(logits.split([1 + len(d) for d in step.drafts])))


class AllocationCounter(TorchDispatchMode):
    """Sums the bytes of the fresh storages operations return (not views of, or in-place writes to, inputs)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.bytes += t.untyped_storage().nbytes()
        return out


def allocated(fn) -> tuple[int, int | None]:
    """(bytes allocated by fn's operations, CUDA peak above what was allocated before, or None)."""
    with AllocationCounter() as counter:
        fn()
    peak = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    return counter.bytes, peak


def measure(drafter: str, batch: int, args, device) -> dict:
    step = make_step(drafter, batch, args.k, args.vocab, args.draft_vocab, device)
    row = {"drafter": drafter, "batch": batch, "k": args.k, "vocab": args.vocab,
           "draft_vocab": args.draft_vocab if drafter == "eagle3" else None}
    seqs, logits = scheduled(step, SamplingParams(temperature=1.0, top_p=args.top_p)), step.target.log()
    fixed = FixedAcceptance(device, capture=device.type == "cuda")
    fixed.fused_kernel = False  # accept_fixed, the baseline (the engine takes the fused kernel on a GPU)
    runs = (("old", lambda: old_step(step)), ("new", lambda: new_step(step)),
            ("sampler", lambda: sampler_step(step, seqs, logits)),
            ("fixed", lambda: fixed.accept(seqs, batch, args.k + 1, logits)))
    if device.type == "cuda":  # the fused kernel (specdec/kernels/accept.py) in the same graph
        fused = FixedAcceptance(device, capture=True)
        fused.fused_kernel = args.top_p >= 1.0  # (a step with top-p keeps accept_fixed)
        runs += (("fused", lambda: fused.accept(seqs, batch, args.k + 1, logits)),)
    for name, fn in runs:
        seconds = timed(fn, device, repeats=args.repeats, warmup=1)
        sync(device)
        nbytes, peak = allocated(fn)
        row[name] = {"ms": round(seconds * 1e3, 3), "allocated_mb": round(nbytes / 1e6, 1),
                     "cuda_peak_mb": None if peak is None else round(peak / 1e6, 1)}
    row["speedup"] = round(row["old"]["ms"] / row["new"]["ms"], 2)
    row["fixed_speedup"] = round(row["sampler"]["ms"] / row["fixed"]["ms"], 2)  # the whole phase, from logits
    if "fused" in row:
        row["fused_speedup"] = round(row["fixed"]["ms"] / row["fused"]["ms"], 2)
        outputs = []
        for acceptance in (fixed, fused):  # the same uniforms: the same tokens (up to float rounding's ~1e-7 a draw)
            torch.manual_seed(0)
            outputs.append(acceptance.accept(seqs, batch, args.k + 1, logits))
        row["fused_same_tokens"] = outputs[0] == outputs[1]
    row["top_p"] = args.top_p
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--draft-vocab", type=int, default=32000, help="eagle3's reduced draft vocabulary")
    p.add_argument("--drafters", default=",".join(DRAFTERS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--top-p", type=float, default=1.0, help="the sampler rows' top-p (< 1: the cut's sort too)")
    args = p.parse_args()
    device = torch.device(args.device)
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        for drafter in args.drafters.split(","):
            rows.append(measure(drafter, batch, args, device))
            r = rows[-1]
            print(f"B={batch:3d} {drafter:13s} old {r['old']['ms']:9.2f} ms {r['old']['allocated_mb']:8.1f} MB | "
                  f"new {r['new']['ms']:9.2f} ms {r['new']['allocated_mb']:8.1f} MB | x{r['speedup']} || "
                  f"sampler {r['sampler']['ms']:9.2f} ms | fixed {r['fixed']['ms']:9.2f} ms | x{r['fixed_speedup']}"
                  + (f" | fused {r['fused']['ms']:7.3f} ms x{r['fused_speedup']}" if "fused" in r else ""),
                  flush=True)
    write_json(args.out, {"environment": environment(device), "threads": torch.get_num_threads(), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
