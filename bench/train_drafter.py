#!/usr/bin/env python3
"""The drafter-training figures: tau at k = 16 of a drafter for ref-target, before and after the pipeline.

Stages:
  1. corpus     the *.py files of this interpreter's site-packages (specdec.data.corpus), split by package
  2. base       a general base model of the drafter's size, pre-trained on the corpus's train split
                (specdec.train.lm; plain language modelling, nothing distilled from the target)
  3. pipeline   specdec.train.drafter from that base: the target's greedy continuations (engine) of prefixes
                of training documents, CE (+ KL) training in bf16, then 4-bit QAT; exports bf16 / FP8 / int4,
                each served and walked by the verifier on the held-out set
  4. results    drafter-training.json: tau_base, tau_bf16, tau_int4, k, the curve of tau against tokens
                trained, verifier records, agreement of the compact exports with bf16, settings and timings

GPU run (one H200):  python3 bench/train_drafter.py --out $OUT
                     (held-out set: bench/results/ref-target-heldout.jsonl, 200 conversations)
CPU dry run (~1 min): python3 bench/train_drafter.py --tiny --out /tmp/train-drafter
                     (a tiny corpus, tokenizer, target and base are made on the spot)
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from specdec.data import bpe, corpus  # noqa: E402
from specdec.train import lm  # noqa: E402
from specdec.train.distill import DistillConfig  # noqa: E402
from specdec.train.drafter import DrafterRun, run_pipeline  # noqa: E402

TINY_SHAPE = lm.ModelShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                           intermediate_size=128, max_position_embeddings=512)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="work directory (corpus, base, the pipeline's run)")
    p.add_argument("--results", default=None,
                   help="results JSON (default: bench/results/drafter-training.json; --tiny: OUT/drafter-training.json)")
    p.add_argument("--tiny", action="store_true", help="CPU dry run at tiny sizes")
    p.add_argument("--target", default="ref-target")
    p.add_argument("--heldout", default=str(REPO / "bench" / "results" / "ref-target-heldout.jsonl"))
    p.add_argument("--base", default=None, help="an existing general base model (default: pre-train one)")
    p.add_argument("--max-corpus-mb", type=float, default=320)
    p.add_argument("--base-minutes", type=float, default=4.0, help="pre-training time of the base")
    p.add_argument("--n-prompts", type=int, default=20000)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-steps", type=int, default=3000, help="bf16 distillation steps")
    p.add_argument("--qat-steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--kl-weight", type=float, default=0.5)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--k", type=int, default=16)
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.tiny:
        tiny = dict(max_corpus_mb=0.4, base_minutes=0.1, n_prompts=24, max_new_tokens=16, max_steps=8, qat_steps=4,
                    batch_size=8, seq_len=64, eval_every=4, device="cpu", lr=3e-3)
        for key, value in tiny.items():
            if f"--{key.replace('_', '-')}" not in (argv or sys.argv[1:]):
                setattr(args, key, value)
    return args


def build_corpus(args, work: Path) -> Path:
    corpus_dir = work / "corpus"
    if not (corpus_dir / "manifest.json").is_file():
        corpus.build_corpus(corpus_dir, int(args.max_corpus_mb * 1e6), 0.1 if args.tiny else 0.03, args.seed,
                            progress=False, built_by="bench/train_drafter.py")
    return corpus_dir


def tiny_target(args, work: Path, corpus_dir: Path) -> tuple[Path, Path]:
    """--tiny: a BPE tokenizer and a briefly trained tiny target (stand-ins for ref-target); held-out prompts."""
    texts = [d["text"] for d in corpus.iter_documents(corpus_dir, "train")]
    bpe.train_tokenizer(texts, work / "tokenizer", 384, model_max_length=512, show_progress=False)
    target = pretrain(args, work / "tiny-target", work / "tokenizer", corpus_dir, TINY_SHAPE, 20.0)
    heldout = corpus.write_jsonl(work / "heldout-prompts.jsonl",
                                 corpus.heldout_prompts(corpus_dir, 6, min_chars=64, max_chars=160, seed=args.seed))
    return target, heldout


def pretrain(args, out: Path, tok_dir: Path, corpus_dir: Path, shape: lm.ModelShape, seconds: float) -> Path:
    """A general model of ``shape`` pre-trained on the corpus (``specdec.train.lm.pretrain``)."""
    if not (out / "config.json").is_file():
        cfg = lm.TrainConfig(seq_len=args.seq_len, batch_size=args.batch_size, max_seconds=seconds,
                             eval_windows=16, seed=args.seed, device=args.device)
        result = lm.pretrain(corpus_dir, tok_dir, out, shape, cfg)
        (out / "pretrain.json").write_text(json.dumps({k: v for k, v in result.items() if k != "history"}) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    t0 = time.monotonic()
    args = parse_args(argv)
    work = Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    times = {}
    corpus_dir = build_corpus(args, work)
    times["corpus"] = round(time.monotonic() - t0, 1)
    if args.tiny:
        target, heldout = tiny_target(args, work, corpus_dir)
        shape = lm.ModelShape(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                              intermediate_size=64, max_position_embeddings=512)
    else:
        from specdec.assets import resolve_model

        target, heldout, shape = resolve_model(args.target), Path(args.heldout), lm.DRAFT_SHAPE
    times["target"] = round(time.monotonic() - t0 - sum(times.values()), 1)
    base = Path(args.base) if args.base else pretrain(args, work / "base", target, corpus_dir, shape,
                                                      args.base_minutes * 60)
    times["base"] = round(time.monotonic() - t0 - sum(times.values()), 1)
    cfg = DistillConfig(seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr, warmup_steps=50,
                        max_steps=args.max_steps, kl_weight=args.kl_weight, corpus_fraction=0.0,
                        seed=args.seed, device=args.device, log_every=25 if not args.tiny else 2)
    run = DrafterRun(str(target), str(base), [str(corpus_dir)], str(work / "run"), str(heldout),
                     n_prompts=args.n_prompts, min_prompt=16 if args.tiny else 32, max_prompt=64 if args.tiny else 384,
                     max_new_tokens=args.max_new_tokens, gen_batch_size=256, heldout_max_tokens=args.max_new_tokens,
                     qat_steps=args.qat_steps, group_size=32, k=args.k, eval_every=args.eval_every,
                     checkpoint_every=args.eval_every, drop_overlap=True, train=cfg)
    result = run_pipeline(run)
    times["pipeline"] = round(time.monotonic() - t0 - sum(times.values()), 1)
    record = {
        "k": result["k"], "tau_base": result["tau_base"], "tau_bf16": result["tau_bf16"],
        "tau_int4": result["tau_int4"], "tau_goal": 7.0,
        "tokens_trained": result["tokens"], "steps": result["steps"], "curve": result["curve"],
        "verified": result.get("verified"), "agreement_with_bf16": result.get("agreement_with_bf16"),
        "target": str(target), "base": str(base), "heldout": str(heldout), "tiny": args.tiny,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "results")},
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "times_s": times,
    }
    path = Path(args.results) if args.results else (work / "drafter-training.json" if args.tiny else
                                                    REPO / "bench" / "results" / "drafter-training.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"k = {record['k']}: tau_base {record['tau_base']}  tau_bf16 {record['tau_bf16']}  "
          f"tau_int4 {record['tau_int4']}  ({record['tokens_trained']:,} tokens trained)  -> {path}")
    print("times (s): " + ", ".join(f"{k} {v}" for k, v in times.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
