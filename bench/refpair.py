#!/usr/bin/env python3
"""Build the reference model pair (ref-target, ref-draft) end to end, in one time-boxed run.

Stages, each with its own share of ``--budget-minutes``:
  1. corpus      the *.py files of this interpreter's site-packages (specdec.data.corpus), held-out split by package
  2. tokenizer   byte-level BPE (specdec.data.bpe) on a seeded sample of the train split
  3. tokenize    both splits, batch-encoded on all cores
  4. pretrain    the target (Qwen3, ~15M params) on packed 512-token windows (specdec.train.lm)  -> ref-target
  5. continue    the target's greedy continuations of training-document prefixes (specdec.train.distill)
  6. distill     the drafter (Qwen3, ~3.7M params): CE on continuations + KL to the target      -> ref-draft
  7. evaluate    held-out loss of both, greedy tau of the drafter for the target at k = 4, 7, 16

Output (``--out``): ref-target/, ref-draft/, heldout-prompts.jsonl, DATA_MANIFEST.md, reference-pair.json.
Each checkpoint is written as soon as it is trained, and reference-pair.json after every stage. With
``--pack-mib N`` the same files go into ``refpair.tar.partNNN`` pieces of at most N MiB instead (plus copies
of reference-pair.json and DATA_MANIFEST.md), for transports that take few, small files; unpack with
``cat refpair.tar.part* | tar -xf - -C specdec/assets``.

GPU run (one H200, ~9 min):  python3 bench/refpair.py --out $OUT --pack-mib 15
CPU dry run (~1 min):        python3 bench/refpair.py --out /tmp/refpair --tiny
"""

from __future__ import annotations

import time

T0 = time.monotonic()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tarfile  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from specdec.data import bpe, corpus  # noqa: E402
from specdec.train import distill, lm  # noqa: E402

SIZE_LIMIT_BYTES = 40_000_000  # both checkpoint directories together
TARGET_SHAPE = lm.ModelShape(hidden_size=384, num_layers=8, num_heads=6, num_kv_heads=2, head_dim=64,
                             intermediate_size=960)
DRAFT_SHAPE = lm.ModelShape(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
                            intermediate_size=768)
TINY = {  # --tiny: a CPU dry run of every stage in about a minute
    "budget_minutes": 1.5, "max_corpus_mb": 1.5, "vocab_size": 512, "tokenizer_train_mb": 1.5,
    "target_hidden_size": 64, "target_num_layers": 2, "target_num_heads": 2, "target_num_kv_heads": 1,
    "target_head_dim": 32, "target_intermediate_size": 128,
    "draft_hidden_size": 32, "draft_num_layers": 1, "draft_num_heads": 2, "draft_num_kv_heads": 1,
    "draft_head_dim": 16, "draft_intermediate_size": 64,
    "seq_len": 128, "batch_size": 16, "target_max_steps": 60, "draft_batch_size": 16, "draft_max_steps": 40,
    "n_prompts": 64, "gen_batch_size": 32, "max_new_tokens": 32, "min_prompt": 16, "max_prompt": 64,
    "n_heldout_prompts": 24, "eval_new_tokens": 32, "eval_windows": 16, "max_shard_size": "100KB",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Flags; ``--tiny`` swaps in the TINY defaults (explicit flags still win)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.split("\n")[1:]))
    p.add_argument("--out", required=True, help="output directory (the GPU run passes $OUT)")
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "specdec-refpair"),
                   help="scratch directory for corpus shards and the tokenizer")
    p.add_argument("--tiny", action="store_true", help="tiny sizes for a CPU dry run")
    p.add_argument("--budget-minutes", type=float, default=8.5, help="wall-clock budget for the whole run")
    p.add_argument("--target-minutes", type=float, default=None, help="pre-training time (default: what is left)")
    p.add_argument("--gen-minutes", type=float, default=None, help="continuations time (default 9%% of budget)")
    p.add_argument("--draft-minutes", type=float, default=None, help="drafter time (default 18%% of budget)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cuda / cpu (default: cuda if available)")
    p.add_argument("--compile", action="store_true", help="torch.compile the training forwards")
    p.add_argument("--pack-mib", type=float, default=0, help="write a tar split in pieces of this many MiB")
    p.add_argument("--max-shard-size", default="16MB", help="safetensors shard size (save_pretrained)")
    g = p.add_argument_group("data")
    g.add_argument("--max-corpus-mb", type=float, default=320, help="cap on raw source bytes read (MB)")
    g.add_argument("--heldout-fraction", type=float, default=0.03)
    g.add_argument("--vocab-size", type=int, default=8192)
    g.add_argument("--tokenizer-train-mb", type=float, default=48, help="text sampled to train the BPE (MB)")
    g = p.add_argument_group("target")
    lm.add_shape_args(g, TARGET_SHAPE, prefix="target-")
    g.add_argument("--seq-len", type=int, default=512)
    g.add_argument("--batch-size", type=int, default=128)
    g.add_argument("--lr", type=float, default=2e-3)
    g.add_argument("--target-max-steps", type=int, default=None)
    g = p.add_argument_group("drafter")
    lm.add_shape_args(g, DRAFT_SHAPE, prefix="draft-")
    g.add_argument("--draft-batch-size", type=int, default=64)
    g.add_argument("--draft-lr", type=float, default=3e-3)
    g.add_argument("--draft-max-steps", type=int, default=None)
    g.add_argument("--kl-weight", type=float, default=1.0)
    g.add_argument("--corpus-fraction", type=float, default=0.25, help="share of drafter batches that is corpus text")
    g.add_argument("--n-prompts", type=int, default=65536, help="most drafter prompts (time-boxed anyway)")
    g.add_argument("--gen-batch-size", type=int, default=512)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--min-prompt", type=int, default=32)
    g.add_argument("--max-prompt", type=int, default=384)
    g = p.add_argument_group("evaluation")
    g.add_argument("--n-heldout-prompts", type=int, default=200)
    g.add_argument("--eval-new-tokens", type=int, default=128)
    g.add_argument("--eval-windows", type=int, default=256)
    if argv is None:
        argv = sys.argv[1:]
    if "--tiny" in argv:
        p.set_defaults(**TINY)
    return p.parse_args(argv)


class Run:
    """State of one run: paths, deadline, results (written to reference-pair.json after each stage)."""

    def __init__(self, args: argparse.Namespace, argv: list[str]):
        self.args = args
        self.out = Path(args.out)
        self.work = Path(args.work)
        self.assets = self.work / "assets" if args.pack_mib else self.out
        for d in (self.out, self.work, self.assets):
            d.mkdir(parents=True, exist_ok=True)
        self.deadline = T0 + args.budget_minutes * 60
        self.device = lm.pick_device(args.device)
        self.command = shlex.join(["python3", "bench/refpair.py", *argv])
        self.results: dict = {
            "command": self.command,
            "gpu": torch.cuda.get_device_name(0) if self.device.type == "cuda" else "none (cpu)",
            "device": str(self.device),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "tokenizers": __import__("tokenizers").__version__,
            "budget_minutes": args.budget_minutes,
            "times_s": {},
            "errors": [],
        }

    def left(self) -> float:
        """Seconds left before the deadline."""
        return self.deadline - time.monotonic()

    def stage(self, name: str, fn, *a, required: bool = False, **kw):
        """Run one stage, time it, log it; on failure record the error (and re-raise if ``required``)."""
        print(f"\n=== {name} ({self.left():.0f}s of budget left) ===", flush=True)
        start = time.monotonic()
        try:
            return fn(*a, **kw)
        except Exception as exc:  # noqa: BLE001 - a failed stage must not lose finished checkpoints
            traceback.print_exc()
            self.results["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
            if required:
                raise
            return None
        finally:
            self.results["times_s"][name] = round(time.monotonic() - start, 1)
            self.save_results()

    def save_results(self) -> None:
        """Write reference-pair.json (in the assets directory, and in --out when packing)."""
        self.results["times_s"].pop("total", None)
        self.results["times_s"]["total"] = round(time.monotonic() - T0, 1)
        text = json.dumps(self.results, indent=1, default=str) + "\n"
        (self.assets / "reference-pair.json").write_text(text)
        if self.args.pack_mib:
            (self.out / "reference-pair.json").write_text(text)

    def pack(self) -> None:
        """With --pack-mib: tar the assets directory into ``refpair.tar.partNNN`` pieces in --out."""
        if not self.args.pack_mib:
            return
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for path in sorted(self.assets.iterdir()):
                tar.add(path, arcname=path.name)
        data, piece = buf.getvalue(), int(self.args.pack_mib * (1 << 20))
        for old in self.out.glob("refpair.tar.part*"):
            old.unlink()
        for i in range(0, len(data), piece):
            (self.out / f"refpair.tar.part{i // piece:03d}").write_bytes(data[i:i + piece])
        print(f"packed {len(data) / 1e6:.1f} MB into {math.ceil(len(data) / piece)} piece(s) in {self.out}", flush=True)


# ---------------------------------------------------------------------------------------------- stages


def build_data(run: Run) -> dict:
    """Corpus + held-out prompts + DATA_MANIFEST.md."""
    a = run.args
    max_bytes = int(a.max_corpus_mb * 1e6) if a.max_corpus_mb else None
    corpus_dir = run.work / "corpus"
    command = corpus.rebuild_command("CORPUS_DIR", max_bytes, a.heldout_fraction, a.seed)
    manifest = corpus.build_corpus(corpus_dir, max_bytes, a.heldout_fraction, a.seed, command=command,
                                   built_by=run.command)
    shutil.copy2(corpus_dir / "DATA_MANIFEST.md", run.assets / "DATA_MANIFEST.md")
    if a.pack_mib:
        shutil.copy2(corpus_dir / "DATA_MANIFEST.md", run.out / "DATA_MANIFEST.md")
    prompts = corpus.heldout_prompts(corpus_dir, a.n_heldout_prompts, seed=a.seed)
    corpus.write_jsonl(run.assets / "heldout-prompts.jsonl", prompts)
    run.results["corpus"] = {
        split: {k: v for k, v in s.items() if k != "shards"} for split, s in manifest["splits"].items()
    }
    run.results["corpus"]["skipped"] = manifest["skipped"]
    run.results["corpus"]["heldout_prompts"] = len(prompts)
    for split, s in manifest["splits"].items():
        print(f"{split}: {s['packages']} packages, {s['files']} files, {s['bytes'] / 1e6:.1f} MB")
    return {"dir": corpus_dir, "prompts": prompts}


def train_tokenizer(run: Run, corpus_dir: Path) -> Path:
    """BPE on a seeded sample (~--tokenizer-train-mb) of the train split."""
    a = run.args
    texts = [d["text"] for d in corpus.iter_documents(corpus_dir, "train")]
    total = sum(len(t) for t in texts)
    keep = min(1.0, a.tokenizer_train_mb * 1e6 / max(total, 1))
    rng = np.random.default_rng(a.seed)
    sample = [t for t in texts if rng.random() < keep] or texts
    tok_dir = run.work / "tokenizer"
    bpe.train_tokenizer(sample, tok_dir, a.vocab_size, model_max_length=a.target_max_position_embeddings,
                        show_progress=False)
    print(f"vocab {a.vocab_size} trained on {sum(len(t) for t in sample) / 1e6:.1f} MB")
    return tok_dir


def tokenize(run: Run, corpus_dir: Path, tok_dir: Path) -> dict:
    """Both splits as per-document token arrays and packed EOS-separated streams."""
    tok = bpe.load_tokenizer(tok_dir)
    ids = bpe.special_ids(tok)
    docs = {split: lm.load_corpus_tokens(corpus_dir, tok, split) for split in corpus.SPLITS}
    streams = {split: lm.pack_documents(docs[split], ids["eos"]) for split in corpus.SPLITS}
    for split in corpus.SPLITS:
        run.results["corpus"][split]["tokens"] = int(len(streams[split]))
        print(f"{split}: {len(streams[split]):,} tokens")
    return {"tok": tok, "ids": ids, "docs": docs, "streams": streams}


def pretrain(run: Run, data: dict, tok_dir: Path, seconds: float) -> Path:
    """Pre-train the target and save it (bf16) as ref-target."""
    a = run.args
    shape = lm.shape_from_args(a, "target_")
    config = lm.qwen3_config(shape, data["tok"].get_vocab_size(), data["ids"]["eos"])
    model = lm.new_model(config, a.seed)
    cfg = lm.TrainConfig(seq_len=a.seq_len, batch_size=a.batch_size, lr=a.lr, max_steps=a.target_max_steps,
                         max_seconds=seconds, eval_windows=min(a.eval_windows, 64), seed=a.seed,
                         device=str(run.device), compile=a.compile)
    run.results["target_params"] = lm.count_params(model)
    run.results["target_shape"] = dataclasses.asdict(shape)
    print(f"target: {run.results['target_params']:,} params, {seconds:.0f}s")
    result = lm.train_lm(model, data["streams"]["train"], data["streams"]["heldout"], cfg)
    out = lm.save_checkpoint(model, run.assets / "ref-target", tok_dir, a.max_shard_size,
                             extra_eos_ids=[data["ids"]["im_end"]])
    run.results["target_train"] = result
    run.pack()
    return out


def continuations(run: Run, data: dict, target_dir: Path, seconds: float) -> list:
    """(prompt, greedy continuation) pairs from prefixes of training documents."""
    a = run.args
    target = distill.load_model(target_dir, run.device)
    pairs = distill.build_distill_pairs(target, data["docs"]["train"], a.n_prompts, a.min_prompt, a.max_prompt,
                                        a.max_new_tokens, a.gen_batch_size, run.device, a.seed, seconds)
    run.results["distill_pairs"] = len(pairs)
    run.results["distill_continuation_tokens"] = int(sum(len(c) for _, c in pairs))
    print(f"{len(pairs)} pairs, {run.results['distill_continuation_tokens']:,} continuation tokens")
    return pairs


def train_draft(run: Run, data: dict, target_dir: Path, pairs: list, seconds: float) -> Path:
    """Distil the drafter and save it (bf16) as ref-draft."""
    a = run.args
    cfg = distill.DistillConfig(seq_len=a.seq_len, batch_size=a.draft_batch_size, lr=a.draft_lr,
                                max_steps=a.draft_max_steps, max_seconds=seconds, eval_points=4,
                                eval_windows=min(a.eval_windows, 64), seed=a.seed, device=str(run.device),
                                compile=a.compile, kl_weight=a.kl_weight,
                                corpus_fraction=a.corpus_fraction if pairs else 1.0)
    windows = lm.eval_windows(data["streams"]["heldout"], a.seq_len, cfg.eval_windows)
    shape = lm.shape_from_args(a, "draft_")
    run.results["draft_shape"] = dataclasses.asdict(shape)
    draft, result = distill.train_drafter(
        target_dir, pairs, run.assets / "ref-draft", shape,
        cfg, corpus_stream=data["streams"]["train"], heldout_windows=windows,
        max_shard_size=a.max_shard_size, extra_eos_ids=[data["ids"]["im_end"]])
    run.results["draft_params"] = result["params"]
    run.results["draft_train"] = result
    run.pack()
    return run.assets / "ref-draft"


def evaluate(run: Run, data: dict, prompts: list, target_dir: Path, draft_dir: Path | None) -> None:
    """Held-out loss/perplexity of both models and the drafter's greedy tau at k = 4, 7, 16."""
    a = run.args
    windows = lm.eval_windows(data["streams"]["heldout"], a.seq_len, a.eval_windows)
    target = distill.load_model(target_dir, run.device)
    r = run.results
    r["target_heldout_loss"] = round(lm.evaluate(target, windows), 4)
    r["target_heldout_ppl"] = round(math.exp(r["target_heldout_loss"]), 3)
    r["heldout_eval_tokens"] = int(windows[:, 1:].numel())
    prompt_ids = [data["tok"].encode(p["prompt"]).ids for p in prompts]
    conts = distill.greedy_continuations(target, prompt_ids, a.eval_new_tokens, 256, run.device)
    r["eval_continuation_mean_len"] = round(float(np.mean([len(c) for c in conts])), 1)
    sample = max(range(len(conts)), key=lambda i: len(conts[i]))
    r["sample"] = {"source": prompts[sample]["source"], "prompt_tail": prompts[sample]["prompt"][-300:],
                   "continuation": data["tok"].decode(conts[sample], skip_special_tokens=False)}
    print(f"--- sample ({prompts[sample]['source']}): prompt tail | target greedy continuation ---")
    print(r["sample"]["prompt_tail"] + "\u2588" + r["sample"]["continuation"])
    print("---")
    run.save_results()
    if draft_dir is None:
        return
    draft = distill.load_model(draft_dir, run.device)
    r["draft_heldout_loss"] = round(lm.evaluate(draft, windows), 4)
    r["draft_heldout_ppl"] = round(math.exp(r["draft_heldout_loss"]), 3)
    matches = distill.draft_matches(draft, prompt_ids, conts)
    r["draft_token_match"] = round(float(np.mean(np.concatenate(matches))), 4)
    for k in (4, 7, 16):
        r[f"tau_k{k}"] = round(distill.acceptance_tau(matches, k), 3)


def check_sizes(run: Run) -> bool:
    """Both checkpoint directories together must stay within SIZE_LIMIT_BYTES."""
    sizes = {name: lm.dir_bytes(run.assets / name) for name in ("ref-target", "ref-draft")
             if (run.assets / name).is_dir()}
    run.results["sizes_bytes"] = {**sizes, "total": sum(sizes.values()), "limit": SIZE_LIMIT_BYTES}
    if sum(sizes.values()) > SIZE_LIMIT_BYTES:
        msg = f"checkpoints are {sum(sizes.values()):,} bytes together, over the {SIZE_LIMIT_BYTES:,} limit"
        print("\n" + "!" * 100 + f"\nFAIL: {msg}\n" + "!" * 100, flush=True)
        run.results["errors"].append(f"size: {msg}")
        return False
    return True


def print_table(run: Run) -> None:
    """The final short table."""
    r = run.results
    rows = [("gpu", r["gpu"])]
    rows += [(f"time {k}", f"{v:.1f}s") for k, v in r["times_s"].items() if k != "total"]
    rows.append(("time total", f"{r['times_s'].get('total', 0):.1f}s"))
    for key in ("target_params", "draft_params", "target_heldout_loss", "target_heldout_ppl", "draft_heldout_loss",
                "draft_heldout_ppl", "draft_token_match", "tau_k4", "tau_k7", "tau_k16", "distill_pairs"):
        if key in r:
            rows.append((key, f"{r[key]:,}" if isinstance(r[key], int) else str(r[key])))
    for name in ("target_train", "draft_train"):
        if name in r:
            t = r[name]
            rows.append((f"{name}", f"{t['steps']} steps, {t['tokens']:,} tok, {t['tokens_per_second']:,} tok/s, "
                                    f"loss {t['first_loss']} -> {t['final_train_loss']}"))
    if "sizes_bytes" in r:
        rows.append(("checkpoint bytes", f"{r['sizes_bytes']['total']:,} (limit {SIZE_LIMIT_BYTES:,})"))
    rows.append(("errors", "; ".join(r["errors"]) or "none"))
    if run.args.pack_mib:
        rows.append(("unpack", f"cat {run.out}/refpair.tar.part* | tar -xf - -C specdec/assets"))
    width = max(len(k) for k, _ in rows)
    print("\n" + "\n".join(f"{k:<{width}}  {v}" for k, v in rows), flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run every stage within the budget; exit 0 only when all stages ran and the sizes fit."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    run = Run(args, argv)
    torch.manual_seed(args.seed)
    budget = args.budget_minutes * 60
    gen_s = (args.gen_minutes * 60) if args.gen_minutes is not None else 0.09 * budget
    draft_s = (args.draft_minutes * 60) if args.draft_minutes is not None else 0.18 * budget
    eval_s = 0.05 * budget
    print(f"device {run.device} ({run.results['gpu']}), budget {budget:.0f}s, out {run.out}", flush=True)
    try:
        data_info = run.stage("corpus", build_data, run, required=True)
        tok_dir = run.stage("tokenizer", train_tokenizer, run, data_info["dir"], required=True)
        data = run.stage("tokenize", tokenize, run, data_info["dir"], tok_dir, required=True)
        target_s = args.target_minutes * 60 if args.target_minutes else max(run.left() - gen_s - draft_s - eval_s, 10)
        target_dir = run.stage("pretrain", pretrain, run, data, tok_dir, target_s, required=True)
        pairs = run.stage("continuations", continuations, run, data, target_dir, gen_s) or []
        draft_dir = run.stage("distill", train_draft, run, data, target_dir, pairs,
                              max(min(draft_s, run.left() - eval_s), 5))
        run.stage("evaluate", evaluate, run, data, data_info["prompts"], target_dir, draft_dir)
    except Exception:  # noqa: BLE001 - a required stage failed: report what exists
        pass
    sizes_ok = check_sizes(run)
    run.save_results()
    run.pack()
    print_table(run)
    return 0 if sizes_ok and not run.results["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
