"""`specdec train lm|distill|drafter|corpus|tokenizer ...`: the training pipeline's commands."""

from __future__ import annotations

import argparse
import importlib

COMMANDS = {
    "corpus": ("specdec.data.corpus", "build the text corpus (Python sources of installed packages)"),
    "tokenizer": ("specdec.data.bpe", "train a byte-level BPE tokenizer on a corpus"),
    "lm": ("specdec.train.lm", "pre-train a small Qwen3 model (--arch qwen3_5: a Qwen3.5 hybrid)"),
    "distill": ("specdec.train.distill", "distill a drafter from a target's greedy continuations"),
    "drafter": ("specdec.train.drafter", "the drafter pipeline: engine continuations, training, QAT, exports"),
    "head": ("specdec.train.head", "an EAGLE-3 head or a Qwen3.5 MTP head (--kind mtp): engine continuations, training-time test, exports"),
}


def add_train_parser(sub) -> None:
    train = sub.add_parser("train", help="build corpora and tokenizers, train models and drafters")
    train.add_argument("what", choices=sorted(COMMANDS), help="; ".join(f"{k}: {v[1]}" for k, v in COMMANDS.items()))
    train.add_argument("args", nargs=argparse.REMAINDER, help="arguments of that stage (see --help of each)")
    train.set_defaults(func=run_train)


def run_train(args: argparse.Namespace) -> int:
    module = importlib.import_module(COMMANDS[args.what][0])
    return int(module.main(args.args) or 0)


def model_dir_arg(parser: argparse.ArgumentParser, flag: str, value: str) -> str:
    """A model directory from a short name (ref-target, ref-draft) or a path; a clear CLI error otherwise."""
    from specdec.assets import resolve_model

    try:
        return str(resolve_model(value))
    except FileNotFoundError as exc:
        parser.error(f"{flag}: {exc}")
