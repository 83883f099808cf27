"""The `specdec` command."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from specdec.drafting.cli import add_draft_parser
from specdec.engine_args import add_engine_args, engine_kwargs
from specdec.errors import SpecdecError
from specdec.speculate.config import add_spec_args
from specdec.judge.cli import add_judge_parsers
from specdec.server.cli import add_serve_parser
from specdec.train.cli import add_train_parser


class _StderrLines(logging.Handler):
    """Each record as a line on the sys.stderr of the moment it is emitted."""

    def emit(self, record: logging.LogRecord) -> None:
        print(self.format(record), file=sys.stderr)


def show_startup() -> None:
    """The start-up's phases (specdec.llm.startup_log) as "specdec: ..." lines on stderr, once per process."""
    log = logging.getLogger("specdec.startup")
    if not any(isinstance(h, _StderrLines) for h in log.handlers):
        handler = _StderrLines()
        handler.setFormatter(logging.Formatter("specdec: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


def cmd_generate(args: argparse.Namespace) -> int:
    from specdec import LLM, SamplingParams
    from specdec.speculate import spec_config_from_args

    show_startup()
    llm = LLM(args.model, speculator=spec_config_from_args(args), **engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop=args.stop or None)
    prompts = args.prompt or [sys.stdin.read()]
    before, started = llm.engine.metrics(), time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1 and llm.is_main_rank)
    seconds = time.perf_counter() - started
    for out in outputs if llm.is_main_rank else []:  # tensor parallel: every rank computes, rank 0 prints
        if args.json:
            print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason}))
        else:
            print(out.text)
    if llm.is_main_rank:
        print(generation_summary(before, llm.engine.metrics(), seconds), file=sys.stderr)
    return 0


def generation_summary(before: dict, after: dict, seconds: float) -> str:
    """One line on what a generate run did: tokens/s and, with a speculator, what speculation did.
    Example: "specdec: 48 tokens in 1.20 s (40.0 tok/s); ngram: 9 of 30 steps verified drafts, 2.44 tokens
    each, 48 % of 27 drafts accepted"."""
    def delta(key):
        return after.get(key, 0) - before.get(key, 0)

    tokens = delta("tokens_emitted")
    line = f"specdec: {tokens} tokens in {seconds:.2f} s ({tokens / max(seconds, 1e-9):.1f} tok/s)"
    if after.get("speculator") is None:
        return line
    verified, drafted = delta("verify_steps"), delta("drafts")
    if not drafted:
        return f"{line}; {after['speculator']}: no step verified drafts (plain decoding was measured faster)"
    draft_tokens, accepted = delta("draft_tokens"), delta("accepted_tokens")
    return (f"{line}; {after['speculator']}: {drafted} of {verified} steps verified drafts, "
            f"{(accepted + drafted) / drafted:.2f} tokens each, {accepted / max(draft_tokens, 1):.0%} of "
            f"{draft_tokens} drafts accepted")


def cmd_twin(args: argparse.Namespace) -> int:
    from pathlib import Path

    from specdec.assets import resolve_model
    from specdec.models.loader import load_model
    from specdec.models.config import ModelConfig
    from specdec.models.twin import check_savable, make_twin, save_twin

    from specdec.models.twin_head import is_head_dir

    source = resolve_model(args.model)
    is_head = is_head_dir(source)
    shape = args.shape
    if shape.endswith(".json"):
        keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")
        keys += ("draft_vocab_size", "target_hidden_size") if is_head else ()
        raw = json.loads(Path(shape).read_text())
        shape = {k: raw[k] for k in keys if k in raw}
    if is_head:  # an EAGLE-3 head: its twin reads the twin of the small target it drafts for
        from specdec.errors import ConfigError
        from specdec.models.twin_head import write_head_twin

        if not args.target:
            raise ConfigError(f"{source} holds an EAGLE-3 head: pass --target DIR, the small target model it drafts "
                              "for (its twin's features are what the head twin reads, and they calibrate it)")
        twin = write_head_twin(source, args.target, shape, args.out, noise=args.noise)
        print(f"wrote {args.out}: {sum(p.numel() for p in twin.parameters()) / 1e6:.1f}M parameters")
        return 0
    check_savable(ModelConfig.from_dir(source))  # before building what could not be written
    twin = make_twin(load_model(source, "cpu"), shape, noise=args.noise)
    save_twin(twin, source, args.out)
    print(f"wrote {args.out}: {sum(p.numel() for p in twin.parameters()) / 1e6:.1f}M parameters")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding engine")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a model directory (or ref-target / ref-draft)")
    gen.add_argument("model", help="Hugging Face model directory, or a bundled short name (ref-target)")
    gen.add_argument("--prompt", action="append", help="prompt text (repeat for several); default: stdin")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--json", action="store_true", help="one JSON object per completion")
    add_engine_args(gen)
    add_spec_args(gen)
    gen.set_defaults(func=cmd_generate)
    add_serve_parser(sub)
    add_draft_parser(sub)
    add_judge_parsers(sub)
    add_train_parser(sub)
    twin = sub.add_parser("twin", help="write a scaled twin: a model padded to a larger shape, same function")
    twin.add_argument("model", help="model directory or short name (ref-target), or an EAGLE-3 head directory")
    twin.add_argument("--target", default=None,
                      help="for an EAGLE-3 head: the small target model it drafts for (the head twin is made for "
                           "that target's twin at the same --shape)")
    twin.add_argument("--shape", required=True, help="qwen3-8b, qwen3-1.7b, qwen3-0.6b, or a config.json with the shape")
    twin.add_argument("--out", required=True)
    twin.add_argument("--noise", type=float, default=0.0, help="std of the padding (1e-6 for benchmark twins)")
    twin.set_defaults(func=cmd_twin)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except SpecdecError as exc:
        print(f"specdec: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
